"""medusa-train: train, tune, export and serve Medusa heads for any Hugging Face causal LM.

Importing the package (or any library module) registers nothing: each entry point registers the config schemas and
resolvers it composes from (:func:`medusa_train.cli.app.register_shared_schemas` and its own) before composing.
"""

from medusa_train.version import __version__

__all__ = ["__version__"]
