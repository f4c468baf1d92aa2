"""The drafter interface every speculative method implements: :class:`Proposer` proposes, the target verifies in one
pass (:func:`inference.decoders.draft.speculative_step`, acceptance in :mod:`medusa_train.tree.acceptance`), the
proposer hears back through its update hook.

Modelled on Hugging Face's ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``,
transformers 5.24 ``generation/candidate_generator.py``) and vLLM's proposers (``propose``): two methods, no shared
base class. Implementations: :class:`~inference.proposers.draft_model.DraftModelProposer` (a draft model) and
:class:`~inference.proposers.lookahead.LookaheadProposer` (Lookahead decoding's n-gram pool and Jacobi window).

Terms: the **committed sequence** is the prompt and the reply so far; its last token, the **root**, has been emitted
but the target has not read it yet (its KV entry is written by the next target pass). A proposal continues the root.

Shapes: G candidate continuations, K drafted tokens per candidate, S auxiliary tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class AuxBranch:
    """Tokens the target reads in the same pass as the candidates without verifying them (Lookahead's window).

    Every auxiliary token sees the committed sequence and the root; among themselves they see what ``mask``
    allows; they never see the candidates and the candidates never see them.

    Attributes:
        tokens: long ``[S]``.
        offsets: long ``[S]``, each token's position relative to the root (root = 0), >= 1.
        mask: bool ``[S, S]``, True where auxiliary token i may attend to auxiliary token j (diagonal True).
        logits_at: long ``[R]``, the auxiliary tokens whose logits the proposer needs back (the lm_head runs on
            those positions only, which matters with a large vocabulary).
    """

    tokens: Tensor
    offsets: Tensor
    mask: Tensor
    logits_at: Tensor

    def __post_init__(self) -> None:
        s = self.tokens.shape[0] if self.tokens.ndim == 1 else -1
        if s < 0 or self.offsets.shape != (s,) or self.mask.shape != (s, s) or self.mask.dtype != torch.bool:
            raise ValueError(
                f"AuxBranch needs tokens [S], offsets [S] and a bool mask [S, S]; got {tuple(self.tokens.shape)}, "
                f"{tuple(self.offsets.shape)}, {self.mask.dtype} {tuple(self.mask.shape)}"
            )
        if self.logits_at.ndim != 1 or (self.logits_at.numel() and not 0 <= int(self.logits_at.min())
                                        <= int(self.logits_at.max()) < s):
            raise ValueError(f"AuxBranch.logits_at must be long [R] with indices in [0, S={s}), "
                             f"got {self.logits_at.tolist()}")


@dataclass(frozen=True)
class Proposal:
    """Drafted continuations of the root, for one target pass.

    Attributes:
        tokens: long ``[G, K]``: G candidate continuations of K drafted tokens each. ``G == 0`` or ``K == 0`` is
            the **empty proposal**: the pass then decodes one token, as plain decoding does.
        probs: float ``[G, K, V]``, the distribution each drafted token was sampled from; None when the tokens were
            chosen deterministically (argmax, n-gram lookup): the verifier then treats each as a point mass.
        aux: an auxiliary branch read in the same pass (None for none).
    """

    tokens: Tensor
    probs: Tensor | None = None
    aux: AuxBranch | None = None

    def __post_init__(self) -> None:
        if self.tokens.ndim != 2 or self.tokens.dtype != torch.long:
            raise ValueError(f"Proposal.tokens must be long [G, K], got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.probs is not None and (self.probs.ndim != 3 or self.probs.shape[:2] != self.tokens.shape):
            raise ValueError(
                f"Proposal.probs must be None or [G, K, V] with [G, K] = {tuple(self.tokens.shape)}, "
                f"got {tuple(self.probs.shape)}"
            )

    @property
    def empty(self) -> bool:
        """True when nothing is drafted (G == 0 or K == 0)."""
        return self.tokens.numel() == 0


def empty_proposal(device: torch.device | str = "cpu", aux: AuxBranch | None = None) -> Proposal:
    """The empty proposal (``tokens`` long ``[0, 0]``): the step falls back to plain decoding (plus ``aux``)."""
    return Proposal(tokens=torch.empty(0, 0, dtype=torch.long, device=device), aux=aux)


@runtime_checkable
class Proposer(Protocol):
    """A drafter for one request: created per ``generate`` call, it holds that request's state (draft KV cache,
    n-gram pool), never state on a model object."""

    def propose(self, sequence: Sequence[int], max_tokens: int) -> Proposal:
        """Draft continuations of ``sequence[-1]`` (the root).

        Args:
            sequence: the committed sequence (prompt + reply so far, the root last).
            max_tokens: the most drafted tokens per candidate that can still be used (the room left in the reply
                after the recovered-or-bonus token); 0 asks for the empty proposal.

        Returns:
            A :class:`Proposal` with ``K <= max_tokens``.
        """
        ...

    def update(self, sequence: Sequence[int], accepted: int, aux_logits: Tensor | None) -> None:
        """Hear the verdict of the pass that verified the last proposal.

        Args:
            sequence: the committed sequence after the pass (its last token is the new root).
            accepted: drafted tokens the verifier kept (0 .. K).
            aux_logits: float ``[1 + R, V]``, the target's logits at the root (row 0) and at the auxiliary tokens
                ``aux.logits_at`` (in that order), when the proposal had an auxiliary branch; else None.
        """
        ...


__all__ = ["AuxBranch", "Proposal", "Proposer", "empty_proposal"]
