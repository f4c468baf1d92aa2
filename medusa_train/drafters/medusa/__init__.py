"""Medusa heads: the module and its catalog entry (:mod:`medusa_train.drafters.medusa.heads`)."""
