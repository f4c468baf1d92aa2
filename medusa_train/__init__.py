"""medusa-train: train, tune, export and serve Medusa heads for any Hugging Face causal LM."""

from medusa_train.config import register_configs
from medusa_train.resolvers import register_resolvers
from medusa_train.version import __version__

register_resolvers()
register_configs()

__all__ = ["__version__"]
