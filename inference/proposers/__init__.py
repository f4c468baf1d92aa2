"""Drafters behind one small interface (:class:`Proposer`: ``propose`` and ``update``), none inheriting from another.

- :class:`DraftModelProposer`: a draft model's K autoregressive tokens (speculative decoding).
- :class:`LookaheadProposer`: Lookahead decoding's n-gram pool and Jacobi window.
- :func:`empty_proposal`: nothing drafted; the step decodes one token as plain decoding does.

Tree decoding's drafters fill a whole candidate tree instead (the protocol
:class:`medusa_train.models.tree_drafter.TreeDrafter`: started per request, then draft and accept per step). Each drafter
type's tree drafter lives in its folder
(:mod:`medusa_train.drafters`) and its catalog entry builds it (:func:`medusa_train.models.catalog.tree_drafter`);
:mod:`inference.proposers.composite` merges any of them with prompt lookup's drafts
(:mod:`inference.proposers.prompt_lookup`) in one tree per step.
"""

from __future__ import annotations

from inference.proposers.base import AuxBranch, Proposal, Proposer, empty_proposal
from inference.proposers.draft_model import DraftModelProposer
from inference.proposers.lookahead import LookaheadProposer, NGramPool, check_lookahead_settings, window_layout

__all__ = [
    "AuxBranch",
    "DraftModelProposer",
    "LookaheadProposer",
    "NGramPool",
    "Proposal",
    "Proposer",
    "check_lookahead_settings",
    "empty_proposal",
    "window_layout",
]
