"""Drafters behind one small interface (:class:`Proposer`: ``propose`` and ``update``), none inheriting from another.

- :class:`DraftModelProposer`: a draft model's K autoregressive tokens (speculative decoding).
- :class:`LookaheadProposer`: Lookahead decoding's n-gram pool and Jacobi window.
- :func:`empty_proposal`: nothing drafted; the step decodes one token as plain decoding does.

Tree decoding's drafters fill a whole candidate tree instead (:mod:`inference.proposers.tree_drafters`,
:class:`TreeDrafter`: started per request, then draft and accept per step; Medusa heads in one call, Hydra heads
level by level); :mod:`inference.proposers.composite` merges any of them with prompt lookup's drafts
(:mod:`inference.proposers.prompt_lookup`) in one tree per step.
"""

from __future__ import annotations

from inference.proposers.base import AuxBranch, Proposal, Proposer, empty_proposal
from inference.proposers.draft_model import DraftModelProposer
from inference.proposers.tree_drafters import HydraTreeDrafter, MedusaTreeDrafter, TreeDrafter, tree_drafter
from inference.proposers.lookahead import LookaheadProposer, NGramPool, check_lookahead_settings, window_layout

__all__ = [
    "AuxBranch",
    "DraftModelProposer",
    "HydraTreeDrafter",
    "LookaheadProposer",
    "MedusaTreeDrafter",
    "NGramPool",
    "Proposal",
    "Proposer",
    "TreeDrafter",
    "check_lookahead_settings",
    "empty_proposal",
    "tree_drafter",
    "window_layout",
]
