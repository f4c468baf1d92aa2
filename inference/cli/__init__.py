"""Entry points of the inference package (Hydra apps): ``medusa-generate`` and ``medusa-eval``."""
