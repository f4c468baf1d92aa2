"""Hydra heads' own settings (``heads.*``, :attr:`medusa_train.models.catalog.DrafterType.options`): how each head combines
the hidden state with the path's embeddings. Defined and checked here only; the heads schema holds them
(:func:`medusa_train.config.schema.heads_schema`) and the catalog entry passes them to :class:`~.heads.HydraSpec`."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.drafters.hydra.heads import COMBINES


@dataclass
class HydraOptions:
    """``heads.*`` of Hydra heads.

    Attributes:
        combine: ``concat`` (the hidden state and the path embeddings concatenated, the paper's) or ``sum``.
    """

    combine: str = "concat"

    def check_options(self) -> None:
        """Raises:
            ValueError: ``heads.combine`` is not one of :data:`~.heads.COMBINES`."""
        if self.combine not in COMBINES:
            raise ValueError(f"heads.combine must be one of {COMBINES}, got {self.combine!r}")


__all__ = ["HydraOptions"]
