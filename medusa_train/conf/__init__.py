"""``medusa_train``'s Hydra presets (``train.yaml``, ``model/``, ``heads/``, ``data/``, ``trainer/``, ...). A package so
that ``inference``'s primary configs find these groups as ``pkg://medusa_train.conf`` (``inference/conf``)."""
