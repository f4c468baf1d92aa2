"""The drafter types, one folder each (``medusa/``, ``hydra/``, ``eagle3/``): a type's module, proposer, export
writer and serving mapping, and its catalog entry (the package's ``__init__``). The catalog
(:mod:`medusa_train.models.catalog`) imports them on its first lookup; no other floor below imports them."""
