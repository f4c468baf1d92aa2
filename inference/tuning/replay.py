"""Replay greedy tree verification on recorded continuations: the mean accepted tokens a tree will measure.

:func:`inference.tuning.search.expected_accept_length` treats every decoding step as an independent draw from
the accuracy table. Real text is not like that: heads are right in runs (boilerplate, code, repeated phrases) and
wrong in runs, and a step that accepts k tokens skips the next k positions, so decoding spends fewer steps in the
easy runs than the table's per-position average assumes and the formula over-predicts τ. Measured here on
SmolLM2-135M with heads from the quickstart and the one-node tree ``[[0]]``: head 0 top-1 accuracy 0.359 on eight
held-out ShareGPT prompts (formula τ 1.359) against a measured τ of 1.27 on the same prompts.

The replay walks the base model's own greedy continuation the way greedy verification does (Medusa paper,
Sec. 2.1.2 and 2.3.3: the accepted candidate is the longest tree path whose tokens all match the base model's).
At each decoding state s (the position whose hidden state the heads read) ``target_ranks[s][k]`` is the rank of the
true token t + k + 2 among head k's top-k, so the accepted path is found by following, from the root, the child
whose rank is that head's target rank, for as long as the child is in the tree. The step emits the accepted tokens
plus one from the base model, and the next state is that many positions on. For greedy decoding this is exactly
what :class:`inference.decoders.TreeDecoder` does on the same prompts, up to floating-point ties between a
teacher-forced pass and a cached one.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_depth(ranks: Sequence[int], tree: set[tuple[int, ...]]) -> int:
    """Tokens greedy verification accepts at one state: the depth of the deepest tree path matching ``ranks``.

    Args:
        ranks: ``[K]`` the rank of head k's target among its top-k candidates, -1 for none.
        tree: the tree's nodes as rank paths (``medusa_choices`` as tuples).
    """
    path: tuple[int, ...] = ()
    for rank in ranks:
        if rank < 0 or path + (rank,) not in tree:
            break
        path = path + (rank,)
    return len(path)


def replay_counts(
    target_ranks: Sequence[Sequence[Sequence[int]]], medusa_choices: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """``(tokens, passes)`` that greedy decoding with ``medusa_choices`` emits and takes over the recorded prompts.

    Args:
        target_ranks: ``[prompt][state][head]`` ints, from :func:`inference.tuning.accuracy.measure_head_accuracy`;
            a prompt whose continuation has N tokens has N - 1 states (the prefill emits the first token).
        medusa_choices: the tree, as rank paths.

    Returns:
        tokens emitted by decoding passes (the prefill's excluded) and the number of decoding passes, the quantities
        :class:`inference.decoders.base.DecodeResult` reports as ``sum(accepted_lengths)`` and ``forward_passes``.
    """
    tree = {tuple(p) for p in medusa_choices}
    tokens = passes = 0
    for states in target_ranks:
        s = 0
        while s < len(states):
            s += 1 + accepted_depth(states[s], tree)
            passes += 1
        tokens += len(states)
    return tokens, passes


def replayed_accept_length(
    target_ranks: Sequence[Sequence[Sequence[int]]], medusa_choices: Sequence[Sequence[int]]
) -> float:
    """Mean accepted tokens (τ, tokens per decoding pass) that greedy decoding with ``medusa_choices`` measures on the
    recorded prompts (see the module docstring).

    Raises:
        ValueError: no state was recorded (every continuation shorter than two tokens).
    """
    tokens, passes = replay_counts(target_ranks, medusa_choices)
    if passes == 0:
        raise ValueError("no decoding state to replay: the recorded continuations are shorter than two tokens")
    return tokens / passes
