"""The Hugging Face peers in our harness: same output as plain greedy decoding, counts derived from the target's
calls, hooks and settings left as they were, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from inference.decoders.base import DecodeConfig
from inference.decoders.hf_peers import (
    HfAssistedDecoder,
    HfPromptLookupDecoder,
    accepted_lengths_from_passes,
    emitted_per_pass,
)
from inference.draft_loading import self_layer_draft
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


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = 0

    def put(self, token_ids: list[int]) -> None:
        self.tokens += token_ids

    def end(self) -> None:
        self.ended += 1


def peers(model: torch.nn.Module, draft: torch.nn.Module, tokenizer=None) -> list:
    return [HfAssistedDecoder(model, draft, 3, tokenizer=tokenizer),
            HfAssistedDecoder(model, draft, 2, "heuristic", confidence_threshold=0.0, tokenizer=tokenizer),
            HfPromptLookupDecoder(model, 4, tokenizer=tokenizer)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_equals_vanilla(family):
    model = varied_model(family)
    decoders = peers(model, self_layer_draft(model, 1))
    # The tiny models' EOS is id 2 (their generation config's too): stop on it only when asked, as our decoders do.
    cases = [(prompt, ()) for prompt in PROMPTS] + [(PROMPTS[0], (2,)), (PROMPTS[2], (2,))]
    for prompt, eos in cases:
        config = DecodeConfig(max_new_tokens=20, eos_token_ids=eos)
        expected = greedy(model, prompt, 20, eos_token_ids=eos)
        for decoder in decoders:
            result = decoder.generate(prompt, config)
            assert result.tokens == expected, (family, prompt, eos, decoder.name)
            assert result.stop_reason == ("eos" if expected[-1] in eos else "max_new_tokens")
            if result.forward_passes:
                check_counts(result)


def test_greedy_equals_vanilla_on_stories260k(stories):
    model, tokenizer = stories
    decoders = [HfAssistedDecoder(model, self_layer_draft(model, 2), 3, tokenizer=tokenizer),
                HfPromptLookupDecoder(model, 4, tokenizer=tokenizer)]
    for text in STORY_PROMPTS[1:]:
        ids = tokenizer(text).input_ids
        expected = greedy(model, ids, 32)
        for decoder in decoders:
            result = decoder.generate(ids, DecodeConfig(max_new_tokens=32))
            assert result.tokens == expected, (text, decoder.name)
            assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
            check_counts(result)


def test_counts_from_the_target_calls():
    """An assistant identical to the target (a copy: the hook must only see the target) with no confidence cut-off
    accepts all K drafts; transformers verifies the first draft inside the prefill call."""
    model = varied_model("llama")
    k, n = 3, 16
    expected = greedy(model, PROMPTS[0], n)
    decoder = HfAssistedDecoder(model, copy.deepcopy(model), k, confidence_threshold=0.0)
    calls = count_calls(model)  # after the copy, which would carry the counting hook along
    result = decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=n))
    assert result.tokens == expected
    # calls emit 4, 4, 4, 4 tokens; the prefill's extra 3 are credited to the first decoding pass
    assert len(calls) == 4 and result.forward_passes == 3
    assert result.accepted_lengths == [3 + 4, 4, 4]
    assert result.mean_accepted_tokens == (n - 1) / 3


def test_emitted_and_accepted_lengths_by_hand():
    # prompt of 5; calls start with caches of 0, 6, 8, 9 positions; 7 new tokens in all
    emitted = emitted_per_pass(5, [0, 6, 8, 9], 7)
    assert emitted == [2, 2, 1, 2] and sum(emitted) == 7
    assert accepted_lengths_from_passes(emitted, 7) == [3, 1, 2]
    assert accepted_lengths_from_passes(emitted, 5) == [3, 1]  # the reply was cut after generate
    assert accepted_lengths_from_passes([3], 3) == []  # everything came from the prefill call
    assert emitted_per_pass(4, [0, 4, 5, 6], 4) == [1, 1, 1, 1]  # plain decoding


def test_hooks_and_generation_config_are_restored_and_streaming_works():
    model = varied_model("llama")
    draft = self_layer_draft(model, 1)
    config_before = draft.generation_config
    streamer = Collector()
    result = HfAssistedDecoder(model, draft, 4, confidence_threshold=0.0).generate(
        PROMPTS[1], DecodeConfig(max_new_tokens=12), streamer)
    assert streamer.tokens == result.tokens == greedy(model, PROMPTS[1], 12) and streamer.ended == 1
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert draft.generation_config is config_before and draft.generation_config.num_assistant_tokens is None


def test_bad_input_is_refused_with_the_field_named():
    model = make_tiny_model("llama")
    draft = self_layer_draft(make_tiny_model("llama", num_hidden_layers=3), 1)
    with pytest.raises(ValueError, match="temperature=0"):
        HfAssistedDecoder(model, draft).generate(PROMPTS[0], DecodeConfig(max_new_tokens=4, temperature=0.5))
    with pytest.raises(ValueError, match="temperature=0"):
        HfPromptLookupDecoder(model).generate(PROMPTS[0], DecodeConfig(max_new_tokens=4, temperature=0.5))
    with pytest.raises(ValueError, match=r"num_draft_tokens \(K, tokens drafted per step\) must be an int >= 1"):
        HfAssistedDecoder(model, draft, 0)
    with pytest.raises(ValueError, match=r"num_draft_tokens \(prompt_lookup_num_tokens\)"):
        HfPromptLookupDecoder(model, 0)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        HfPromptLookupDecoder(model, 3, max_matching_ngram_size=0)
    with pytest.raises(ValueError, match="draft vocabulary size 50 != target vocabulary size 97"):
        HfAssistedDecoder(model, make_tiny_model("llama", vocab_size=50))
    with pytest.raises(ValueError, match="draft is the target model object itself"):
        HfAssistedDecoder(model, model)
    with pytest.raises(ValueError, match="schedule must be one of"):
        HfAssistedDecoder(model, draft, schedule="dynamic")
    with pytest.raises(ValueError, match=r"max_new_tokens \(300\)"):
        HfPromptLookupDecoder(make_tiny_model("gpt2")).generate(PROMPTS[0], DecodeConfig(max_new_tokens=300))
