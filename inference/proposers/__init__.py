"""Drafters behind one small interface (:class:`Proposer`: ``propose`` and ``update``), none inheriting from another.

- :class:`DraftModelProposer`: a draft model's K autoregressive tokens (speculative decoding).
- :class:`LookaheadProposer`: Lookahead decoding's n-gram pool and Jacobi window.
- :func:`empty_proposal`: nothing drafted; the step decodes one token as plain decoding does.
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
