"""medusa-train: train, tune, export and serve Medusa heads for any Hugging Face causal LM."""

from medusa_train.config import register_configs
from medusa_train.resolvers import register_resolvers

register_resolvers()
register_configs()

__version__ = "0.1.0"
