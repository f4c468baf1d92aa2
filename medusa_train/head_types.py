"""The kinds of draft heads: Medusa (:mod:`medusa_train.heads`) and Hydra (:mod:`medusa_train.hydra_heads`).

One place names them, builds empty heads of a spec, and checks a head type read from a file or asked for by a
caller, so that heads of one kind are never read as the other.
"""

from __future__ import annotations

import torch

from medusa_train.heads import HeadsSpec, MedusaHeads
from medusa_train.hydra_heads import HydraHeads, HydraSpec

HEAD_TYPES = ("medusa", "hydra")
DRAFT_HEADS = (MedusaHeads, HydraHeads)
DraftHeads = MedusaHeads | HydraHeads


def check_head_type(head_type: object, source: str) -> str:
    """``head_type`` when it is one of :data:`HEAD_TYPES`.

    Raises:
        ValueError: another value, naming ``source`` (e.g. an export's config.json) and the known types.
    """
    if head_type not in HEAD_TYPES:
        raise ValueError(f"{source}: head_type {head_type!r} is not one this medusa-train knows "
                         f"({', '.join(HEAD_TYPES)}); upgrade medusa-train or check the file")
    return str(head_type)


def expect_head_type(found: str, wanted: str | None, source: str) -> None:
    """Refuse heads of type ``found`` where ``wanted`` heads were asked for (None: any type).

    Raises:
        ValueError: naming both head types and ``source``.
    """
    if wanted is None or wanted == found:
        return
    check_head_type(wanted, "the head type asked for")
    raise ValueError(f"{source} holds {found.capitalize()} heads (head_type {found!r}), but {wanted.capitalize()} "
                     f"heads (head_type {wanted!r}) were asked for; use an export of {wanted} heads, or load these as "
                     f"{found} heads")


def heads_from_spec(spec: HeadsSpec, token_map: torch.Tensor | None = None) -> DraftHeads:
    """Zero-initialised heads of ``spec``'s kind (:class:`HydraHeads` for a :class:`HydraSpec`)."""
    return HydraHeads(spec, token_map) if isinstance(spec, HydraSpec) else MedusaHeads(spec, token_map)


__all__ = ["DRAFT_HEADS", "DraftHeads", "HEAD_TYPES", "check_head_type", "expect_head_type", "heads_from_spec"]
