"""The repeat drafter's own setting, ``heads.scale`` (:attr:`medusa_train.models.catalog.DrafterType.options`): defined, bounded
and checked here only; the heads schema holds it while the type is registered."""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_train.config.bounds import bound


@dataclass
class RepeatOptions:
    """``heads.*`` of the repeat drafter.

    Attributes:
        scale: the heads' logits are multiplied by it (> 0; :class:`~tests.toy_drafter.heads.RepeatSpec`).
    """

    scale: float = field(default=1.0, metadata=bound(0, low_open=True, hint="the heads' logit scale"))

    def check_options(self) -> None:
        """Run on the whole heads config (``self`` has every ``heads.*`` field), before anything loads.

        Raises:
            ValueError: ``heads.scale`` other than 1 with ``heads.share_lm_head=true``: the repeat heads then report
                sharing a projection they scale, which no reader would expect (its bound refuses <= 0 first)."""
        if self.scale != 1.0 and getattr(self, "share_lm_head", False):
            raise ValueError(f"heads.scale={self.scale} scales the repeat heads' own projection: with "
                             "heads.share_lm_head=true leave heads.scale=1")


__all__ = ["RepeatOptions"]
