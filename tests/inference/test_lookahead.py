"""Lookahead decoding: greedy output equal to plain greedy decoding, the window's mask and update, the n-gram pool,
exact acceptance counts, and clear errors."""

from __future__ import annotations

import pytest
import torch

from inference.decoders.base import DecodeConfig
from inference.decoders.lookahead import LookaheadDecoder
from inference.proposers import LookaheadProposer, NGramPool, Proposer, window_layout
from tests.conftest import make_tiny_model
from tests.inference.test_draft import (  # noqa: F401  (fixtures)
    PROMPTS,
    STORY_PROMPTS,
    check_counts,
    count_calls,
    greedy,
    one_thread,
    stories,
    varied_model,
)


# --- greedy output = plain greedy output ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_equals_vanilla(family):
    for model in (varied_model(family), make_tiny_model(family)):  # varied replies, and repetitive ones
        for prompt in PROMPTS:
            expected = greedy(model, prompt, 24)
            for window, ngram, guesses, prompt_ngrams in ((4, 3, 4, True), (5, 4, 5, False), (1, 2, 1, False)):
                result = LookaheadDecoder(model, window, ngram, guesses, prompt_ngrams).generate(
                    prompt, DecodeConfig(max_new_tokens=24))
                assert result.tokens == expected, (family, prompt, window, ngram, guesses)
                check_counts(result)


def test_greedy_equals_vanilla_on_stories260k(stories):
    model, tokenizer = stories
    decoder = LookaheadDecoder(model, window=5, ngram=4, guesses=5, tokenizer=tokenizer)
    passes = 0
    for text in STORY_PROMPTS:
        ids = tokenizer(text).input_ids
        result = decoder.generate(ids, DecodeConfig(max_new_tokens=48))
        assert result.tokens == greedy(model, ids, 48)
        check_counts(result)
        passes += result.forward_passes
    assert passes < 3 * 47  # the repetitive stories let some n-grams through


# --- counts -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("ngram", [2, 4])
def test_pool_seeded_with_the_true_continuation_accepts_n_minus_1_per_verification(family, ngram):
    model = varied_model(family)
    prompt, steps = PROMPTS[0], 5
    n = 1 + ngram * steps  # the prefill's token, then N - 1 accepted + 1 bonus per pass
    continuation = greedy(model, prompt, n + ngram)
    sequence = prompt[-1:] + continuation
    seeds = [sequence[i : i + ngram] for i in range(len(sequence) - ngram + 1)]
    calls = count_calls(model)
    result = LookaheadDecoder(model, window=3, ngram=ngram, guesses=8, prompt_ngrams=False,
                              initial_ngrams=seeds).generate(prompt, DecodeConfig(max_new_tokens=n))
    assert result.tokens == continuation[:n]
    assert result.accepted_lengths == [ngram] * steps
    assert result.mean_accepted_tokens == ngram
    assert len(calls) == 1 + steps


def test_jacobi_window_fills_the_pool_after_warm_up():
    """A repetitive reply (tiny GPT-2 repeats one token): no n-gram is collected during the N - 2 warm-up passes,
    the third pass collects the repeated n-gram, and from the fourth on every verification accepts N - 1 tokens."""
    model = make_tiny_model("gpt2")
    result = LookaheadDecoder(model, window=5, ngram=4, guesses=5, prompt_ngrams=False).generate(
        PROMPTS[0], DecodeConfig(max_new_tokens=40))
    assert result.tokens == greedy(model, PROMPTS[0], 40) == [20] * 40
    assert result.accepted_lengths == [1, 1, 1] + [4] * 9


# --- the window, its mask and its update --------------------------------------------------------------------------

def test_window_layout_by_hand():
    offsets, mask = window_layout(window=3, ngram=3)
    # tokens (level, column): (0,1) (0,2) (1,0) (1,1) (1,2); the root (0,0) is not listed
    assert offsets.tolist() == [1, 2, 1, 2, 3]
    expected = torch.tensor([[1, 0, 0, 0, 0],   # (0,1): itself
                             [1, 1, 0, 0, 0],   # (0,2): level 0 up to its column
                             [0, 0, 1, 0, 0],   # (1,0): the root, itself
                             [1, 0, 0, 1, 0],   # (1,1): (0,1) then itself
                             [1, 1, 0, 0, 1]],  # (1,2): (0,1), (0,2), itself
                            dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_window_update_and_ngram_collection_by_hand():
    vocab = 16
    proposer = LookaheadProposer([1, 2, 3], window=2, ngram=3, guesses=4, prompt_ngrams=False)
    assert isinstance(proposer, Proposer)
    proposer.window = torch.tensor([[0, 5], [6, 7]])  # level 0: root slot, 5; level 1: 6, 7

    def logits_with_argmax(tokens: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()  # [1 + W, V]

    proposal = proposer.propose([1, 2, 3, 9], max_tokens=2)
    assert proposal.empty  # nothing pooled yet; the window still rides along
    assert proposal.aux.tokens.tolist() == [5, 6, 7] and proposer.window[0, 0] == 9
    assert proposal.aux.logits_at.tolist() == [1, 2]  # the top level's tokens: logits of the rest are not needed
    proposer.update([1, 2, 3, 9, 10], 0, logits_with_argmax([11, 13, 14]))  # root row, top level: guesses 13, 14
    assert len(proposer.pool) == 0  # warm-up: N - 2 = 1 pass
    assert proposer.window.tolist() == [[10, 7], [13, 14]]
    proposer.update([1, 2, 3, 9, 10, 4], 0, logits_with_argmax([0, 8, 15]))
    # one n-gram per column: (level 0, level 1, new guess)
    assert proposer.pool.continuations(10) == [(13, 8)] and proposer.pool.continuations(7) == [(14, 15)]
    assert proposer.window.tolist() == [[4, 14], [8, 15]]
    proposal = proposer.propose([1, 2, 3, 9, 10, 4, 7], max_tokens=5)
    assert proposal.tokens.tolist() == [[14, 15]]
    assert proposer.propose([1, 2, 3, 9, 10, 4, 7], max_tokens=1).tokens.tolist() == [[14]]
    assert proposer.propose([1, 2, 3, 9, 10, 4, 7], max_tokens=0).empty


def test_prompt_ngrams_are_proposed_most_recent_first():
    proposer = LookaheadProposer([1, 2, 3, 1, 2, 4, 1, 2, 3], window=2, ngram=3, guesses=5)
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2, 3, 1], max_tokens=5).tokens.tolist() == [[2, 3], [2, 4]]
    # continuations equal after the cut are verified once
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2, 3, 1], max_tokens=1).tokens.tolist() == [[2]]


def test_ngram_pool_keeps_the_g_most_recent_per_key():
    pool = NGramPool(n=3, capacity=2)
    pool.add_sequence([5, 1, 2, 5, 3, 4])  # (5,1,2) (1,2,5) (2,5,3) (5,3,4)
    assert pool.continuations(5) == [(1, 2), (3, 4)] and len(pool) == 4
    pool.add([5, 1, 2])  # re-adding makes it the most recent
    assert pool.continuations(5) == [(3, 4), (1, 2)]
    pool.add([5, 9, 9])  # a full key drops its least recent
    assert pool.continuations(5) == [(1, 2), (9, 9)]
    assert pool.continuations(42) == []
    with pytest.raises(ValueError, match="N=3 tokens"):
        pool.add([1, 2])


# --- errors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(window=0), "window"), (dict(window=-3), "window"), (dict(ngram=0), "ngram"), (dict(ngram=1), "ngram"),
    (dict(guesses=0), "guesses"), (dict(window=2.5), "window"), (dict(guesses=True), "guesses"),
])
def test_bad_settings_name_the_field(kwargs, field):
    model = make_tiny_model("llama")
    with pytest.raises(ValueError, match=rf"^{field} \("):
        LookaheadDecoder(model, **kwargs)


def test_other_errors():
    model = make_tiny_model("llama")
    with pytest.raises(ValueError, match="temperature=0"):
        LookaheadDecoder(model).generate(PROMPTS[0], DecodeConfig(max_new_tokens=4, temperature=0.7))
    with pytest.raises(ValueError, match="initial_ngrams must hold N=4 tokens"):
        LookaheadDecoder(model, ngram=4, initial_ngrams=[[1, 2, 3]])
    with pytest.raises(ValueError, match=r"max_new_tokens \(300\)"):
        LookaheadDecoder(make_tiny_model("gpt2")).generate(PROMPTS[0], DecodeConfig(max_new_tokens=300))
    sliding = make_tiny_model("mistral", sliding_window=8)
    with pytest.raises(NotImplementedError, match="sliding"):
        LookaheadDecoder(sliding)
