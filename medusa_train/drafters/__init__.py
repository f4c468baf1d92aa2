"""Drafter types and their catalog (:mod:`medusa_train.drafters.catalog`)."""
