"""Lookahead decoding's drafter: an n-gram pool filled by Jacobi iterations over a 2-D window (Fu et al. 2024,
"Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", ICML 2024, Sec. 3.1-3.3 and Fig. 2).

**Window.** ``N - 1`` levels of ``W`` tokens, ``window[l, j]`` (level 0 the oldest) at position ``j + l`` after the
root; ``window[0, 0]`` is the root itself. One target pass reads the whole window (the *lookahead branch*, the
:class:`~inference.proposers.base.AuxBranch` of every proposal): token ``(l, j)`` attends to the root,
``window[0, 1..j]`` and ``window[1..l, j]``, i.e. to the latest guess of every earlier position along its own
Jacobi trajectory (the paper's Fig. 2b; hao-ai-lab/LookaheadDecoding ``lade/models/llama.py``
``j_make_causal_mask_multilevel`` at 7571393). The target's argmax at ``(N - 2, j)`` is the new guess for position
``j + N - 1``, one Jacobi iteration for all W columns at once.

**Pool.** Column j then yields the n-gram ``(window[0, j], ..., window[N - 2, j], new_j)``; the pool maps its first
token to the N - 1 tokens after it, at most G continuations per key (least recently added dropped first, as LADE
``update_token_map``). With ``prompt_ngrams`` the prompt's n-grams and the reply's are added too (LADE's
``POOL_FROM_PROMPT``). The pool is updated after every pass.

**Window update** (LADE's ``ALWAYS_FWD_ONE``): the levels move up by one (level 0 takes level 1 from its second
column, the new root first), the new guesses become the top level. The window starts as tokens of the prompt drawn
with a fixed seed (LADE draws them at random from the prompt); while a level above level 0 still holds such initial
tokens (the first N - 2 passes) no n-gram is collected from the window. As in LADE, the first n-grams collected
still start with initial tokens (level 0 is the last to be replaced).

**Verification branch** (:meth:`LookaheadProposer.propose`): up to G pool continuations of the root, each cut to
the room left, verified greedily by the target in the same pass (:mod:`medusa_train.tree.acceptance`), so the output is
exactly greedy decoding's.

Shapes: W window, N n-gram size, G guesses, S = (N - 1) W - 1 auxiliary tokens, V vocabulary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from inference.proposers.base import AuxBranch, Proposal, empty_proposal

WINDOW_SEED = 0  # seed of the initial window's draw from the prompt (fixed: decoding stays reproducible)


def check_lookahead_settings(window: int, ngram: int, guesses: int) -> None:
    """Raise ``ValueError`` naming the field unless W >= 1, N >= 2 and G >= 1 (all ints).

    N = 1 would be an n-gram with no continuation (nothing to verify); the paper's smallest is N = 2 (Jacobi
    decoding with a pool).
    """
    for name, value, low, meaning in (("window", window, 1, "W, lookahead window size"),
                                      ("ngram", ngram, 2, "N, n-gram size"),
                                      ("guesses", guesses, 1, "G, candidate n-grams verified per step")):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} ({meaning}) must be an int >= {low}, got {value!r}")


class NGramPool:
    """n-grams by first token: ``key -> continuations`` (tuples of N - 1 tokens), at most ``capacity`` per key.

    Adding a continuation already present makes it the most recent; adding one to a full key drops the least recent.

    Args:
        n: N, the n-gram size (>= 2).
        capacity: G, continuations kept per key (>= 1).
    """

    def __init__(self, n: int, capacity: int) -> None:
        check_lookahead_settings(1, n, capacity)
        self.n = n
        self.capacity = capacity
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        """Add one n-gram (N token ids).

        Raises:
            ValueError: ``ngram`` does not hold N tokens.
        """
        if len(ngram) != self.n:
            raise ValueError(f"an n-gram of this pool holds N={self.n} tokens, got {len(ngram)}: {list(ngram)}")
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        entries = self.table.setdefault(key, OrderedDict())
        entries.pop(rest, None)
        entries[rest] = None
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Add every n-gram of ``tokens`` (nothing when it is shorter than N)."""
        for i in range(len(tokens) - self.n + 1):
            self.add(tokens[i : i + self.n])

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The continuations stored for ``key``, least recent first (empty list when none)."""
        return list(self.table.get(int(key), ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


def window_layout(window: int, ngram: int) -> tuple[Tensor, Tensor]:
    """Offsets and visibility of the lookahead branch, root excluded (the root is ``window[0, 0]``).

    Args:
        window: W.
        ngram: N.

    Returns:
        ``(offsets, mask)``: long ``[S]``, position after the root of each window token in row-major order
        ``(l, j)`` without ``(0, 0)``, i.e. ``j + l``; bool ``[S, S]``, True where token ``(l, j)`` sees token
        ``(l', j')``: ``l' = 0`` and ``1 <= j' <= j``, or ``1 <= l' <= l`` and ``j' = j``. S = (N - 1) W - 1.
    """
    levels = torch.arange(ngram - 1).repeat_interleave(window)  # [(N-1) W]
    columns = torch.arange(window).repeat(ngram - 1)
    same_column = (columns[:, None] == columns[None, :]) & (levels[None, :] <= levels[:, None])
    level_zero = (levels[None, :] == 0) & (columns[None, :] <= columns[:, None])
    mask = same_column | level_zero
    return (levels + columns)[1:], mask[1:, 1:]


class LookaheadProposer:
    """Lookahead decoding's drafter for one request (see the module docstring).

    Args:
        prompt: the prompt's token ids (the initial window is drawn from them).
        window: W >= 1.
        ngram: N >= 2.
        guesses: G >= 1, the most candidates verified per pass and continuations kept per key.
        prompt_ngrams: put the prompt's n-grams in the pool, and the reply's as it is committed.
        initial_ngrams: n-grams (N tokens each) put in the pool before decoding (e.g. from a corpus).
        device: where the proposal tensors go.

    Raises:
        ValueError: a setting out of range (named), an empty prompt, or an initial n-gram of another length.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        window: int,
        ngram: int,
        guesses: int,
        prompt_ngrams: bool = True,
        initial_ngrams: Iterable[Sequence[int]] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        check_lookahead_settings(window, ngram, guesses)
        if not prompt:
            raise ValueError("prompt is empty: the lookahead window is drawn from the prompt's tokens")
        self.w, self.n, self.g = window, ngram, guesses
        self.device = torch.device(device)
        self.prompt_ngrams = prompt_ngrams
        self.pool = NGramPool(ngram, guesses)
        for gram in initial_ngrams:
            self.pool.add(gram)
        if prompt_ngrams:
            self.pool.add_sequence(prompt)
        draw = torch.Generator().manual_seed(WINDOW_SEED)
        picks = torch.randint(len(prompt), ((ngram - 1) * window,), generator=draw)
        self.window = torch.tensor(list(prompt), dtype=torch.long)[picks].view(ngram - 1, window)  # [N-1, W]
        offsets, mask = window_layout(window, ngram)
        self.offsets, self.mask = offsets.to(self.device), mask.to(self.device)
        # logits are needed at the top level only (its next tokens are the new guesses); for N = 2 the top level is
        # level 0, whose first token is the root (always returned)
        top = torch.arange((ngram - 2) * window, (ngram - 1) * window) - 1
        self.logits_at = top[top >= 0].to(self.device)
        self.passes = 0  # window passes so far (the first N - 2 are warm-up)
        self.committed = len(prompt)

    def propose(self, sequence: Sequence[int], max_tokens: int) -> Proposal:
        """Up to G pool continuations of the root, cut to ``max_tokens`` (``tokens [G', K]``, K = min(N - 1,
        max_tokens)), and the window as the auxiliary branch; the empty proposal (window only) when the pool has
        nothing for the root or ``max_tokens`` is 0."""
        self.window[0, 0] = int(sequence[-1])
        aux = AuxBranch(tokens=self.window.flatten()[1:].to(self.device), offsets=self.offsets, mask=self.mask,
                        logits_at=self.logits_at)
        k = min(self.n - 1, max_tokens)
        # Most recent first; continuations equal after the cut are verified once.
        candidates = list(dict.fromkeys(c[:k] for c in reversed(self.pool.continuations(sequence[-1]))))
        if k <= 0 or not candidates:
            return empty_proposal(self.device, aux)
        tokens = torch.tensor(candidates[: self.g], dtype=torch.long, device=self.device)
        return Proposal(tokens=tokens, aux=aux)

    def update(self, sequence: Sequence[int], accepted: int, aux_logits: Tensor | None) -> None:
        """One Jacobi iteration's result: collect the window's n-grams into the pool (after warm-up), move the
        window up a level, add the newly committed n-grams (``prompt_ngrams``).

        Raises:
            ValueError: ``aux_logits`` is not ``[1 + R, V]``: the root's row, then the top level's (``logits_at``).
        """
        rows = 1 + self.logits_at.numel()
        if aux_logits is None or aux_logits.ndim != 2 or aux_logits.shape[0] != rows:
            raise ValueError(f"aux_logits must be [1 + R = {rows}, V] (the root's row, then the top level's), got "
                             f"{None if aux_logits is None else tuple(aux_logits.shape)}")
        guesses = aux_logits[-self.w :].argmax(dim=-1).cpu()  # [W], the top level's next tokens
        if self.passes >= self.n - 2:
            for gram in torch.cat([self.window, guesses.unsqueeze(0)]).T.tolist():  # W n-grams, one per column
                self.pool.add(gram)
        if self.n == 2:
            self.window[0, 1:] = guesses[1:]
        else:
            self.window[0, 1:] = self.window[1, 1:].clone()
            self.window[1:-1] = self.window[2:].clone()
            self.window[-1] = guesses
        self.window[0, 0] = int(sequence[-1])
        self.passes += 1
        if self.prompt_ngrams:
            self.pool.add_sequence(sequence[max(self.committed - self.n + 1, 0):])
        self.committed = len(sequence)


__all__ = ["LookaheadProposer", "NGramPool", "check_lookahead_settings", "window_layout"]
