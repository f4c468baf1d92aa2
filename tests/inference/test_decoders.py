"""Decoders on tiny random models: exact greedy equality, exact acceptance counts, stops, errors, and a sampler that
keeps the target distribution."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import TextStreamer

from inference.decoders import (
    DecodeConfig,
    TreeDecoder,
    VanillaDecoder,
    aggregate_mean_accepted_tokens,
    default_medusa_choices,
    generate,
)
from inference.decoders.chat import chat_prompt_ids, eos_ids
from inference.decoders.tree import tree_attention_mask
from medusa_train.models.catalog import drafter_type, head_types
from medusa_train.models.features import count_layers
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from medusa_train.tree.buffers import MC_SIM_7B_63, SMALL_TREE_15, build_tree_buffers, chain_choices
from tests.conftest import FAMILIES, chi_square, make_tiny_model

PROMPTS = ([1, 5, 9, 33, 20], [1, 70], [1, 44, 12, 90, 3, 3, 61, 8, 17])
SMALL_TREE = [list(p) for p in SMALL_TREE_15]  # depth 3, 16 nodes, ranks < 6


pytestmark = pytest.mark.usefixtures("one_thread")


def random_medusa(base: torch.nn.Module, num_heads: int = 3, seed: int = 0) -> SpeculativeModel:
    """Heads with random residual blocks: they disagree with the base often, so many drafts are rejected."""
    heads = new_heads_for(base, num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.block_weight.copy_(torch.randn(heads.block_weight.shape, generator=generator) * 0.3)
    return SpeculativeModel(base, heads)


def count_backbone_calls(model: torch.nn.Module) -> list[int]:
    """A list that grows by one per backbone forward pass (a forward hook; nothing is patched)."""
    calls: list[int] = []
    backbone = model.backbone if isinstance(model, SpeculativeModel) else model.base_model
    backbone.register_forward_hook(lambda *args: calls.append(1))
    return calls


class LookupHeadsMedusa(SpeculativeModel):
    """Test-only Medusa model whose heads are perfect: head k at position t predicts ``sequence[t + k + 2]``.

    The position is recovered from the hidden state itself: the nearest of the hidden states the base model computes
    over ``sequence`` (the prompt followed by its greedy continuation). Logits are one-hot.
    """

    def __init__(self, base: torch.nn.Module, num_heads: int, sequence: list[int]) -> None:
        super().__init__(base, new_heads_for(base, num_heads))
        with torch.no_grad():
            self.table = base.base_model(torch.tensor([sequence])).last_hidden_state[0]  # [S, H]
        self.sequence = sequence

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
        position = torch.cdist(flat.float(), self.table.float()).argmin(dim=-1)  # [M]
        K, V = num_heads or self.heads.spec.num_heads, self.heads.spec.out_size
        logits = torch.zeros(K, flat.shape[0], V)
        for k in range(K):
            for m, t in enumerate(position.tolist()):
                logits[k, m, self.sequence[t + k + 2]] = 1.0
        return logits.reshape(K, *hidden.shape[:-1], V)


class CharTokenizer:
    """Test tokenizer: id i is the character chr(32 + i); no chat template."""

    eos_token_id = 2
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return "".join(chr(32 + int(i)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + [ord(c) - 32 for c in text])


class Collector:
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = 0

    def put(self, token_ids: list[int]) -> None:
        self.chunks.append(list(token_ids))

    def end(self) -> None:
        self.ended += 1


def greedy(base: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    return VanillaDecoder(base).generate(prompt, DecodeConfig(max_new_tokens=n)).tokens


def check_counts(result) -> None:
    """The counting invariants of DecodeResult (base.py's module docstring)."""
    assert len(result.tokens) == 1 + sum(result.accepted_lengths)
    assert len(result.accepted_lengths) == result.forward_passes
    assert all(n >= 1 for n in result.accepted_lengths)


# --- plain decoding -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_vanilla_greedy_equals_hf_generate(family):
    base = make_tiny_model(family)
    calls = count_backbone_calls(base)
    for prompt in PROMPTS:
        hf = base.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)
        expected = hf[0, len(prompt):].tolist()
        if 2 in expected:  # HF stops after EOS (id 2) and pads; we keep the EOS and stop the same way
            expected = expected[: expected.index(2) + 1]
        before = len(calls)
        result = VanillaDecoder(base).generate(prompt, DecodeConfig(max_new_tokens=24, eos_token_ids=(2,)))
        assert len(calls) - before == 1 + result.forward_passes == len(result.tokens)
        assert result.tokens == expected
        check_counts(result)
        if result.forward_passes:
            assert result.mean_accepted_tokens == 1.0


def test_vanilla_sampling_is_reproducible_by_seed():
    base = make_tiny_model("llama")
    decoder = VanillaDecoder(base)
    a = decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=12, temperature=1.0, seed=7)).tokens
    b = decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=12, temperature=1.0, seed=7)).tokens
    c = decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=12, temperature=1.0, seed=8)).tokens
    assert a == b and a != c and len(a) == 12


# --- Medusa greedy = plain greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("head_type", head_types())  # every type in the drafter catalog
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_medusa_greedy_equals_vanilla_greedy_random_heads(family, head_type):
    base = make_tiny_model(family)
    model = random_heads(head_type, base)
    decoder = TreeDecoder(model, SMALL_TREE, topk=10)
    calls = count_backbone_calls(model)
    for prompt in PROMPTS:
        before = len(calls)
        result = decoder.generate(prompt, DecodeConfig(max_new_tokens=40))
        assert len(calls) - before == 1 + result.forward_passes  # drafting never runs the backbone
        assert result.tokens == greedy(base, prompt, 40), (family, prompt)
        check_counts(result)
        assert result.stop_reason == "max_new_tokens"


class HostReads:
    """Counts a tensor's reads by the host (``tolist``, ``item``, ``int``, ``bool``, ``float``) while ``active``."""

    METHODS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.active, self.count = False, 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += self.active
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_a_medusa_step_reads_the_host_once_and_the_cache_is_checked_once_per_request(monkeypatch):
    import inference.decoders.tree as medusa
    import medusa_train.tree.kv_cache as kv_cache

    base = make_tiny_model("llama")
    model = random_medusa(base)
    checks = []
    monkeypatch.setattr(medusa, "check_compactable", lambda cache: checks.append(type(cache).__name__)
                        or kv_cache.check_compactable(cache))
    reads, steps = HostReads(monkeypatch), []
    backbone = model.hidden

    def step(*args, **kwargs):  # count the step's own reads, not the backbone's (transformers' code)
        reads.active = True
        try:
            return original_step(*args, **kwargs)
        finally:
            reads.active = False
            steps.append(reads.count)

    def hidden(*args, **kwargs):
        active, reads.active = reads.active, False
        try:
            return backbone(*args, **kwargs)
        finally:
            reads.active = active

    original_step = medusa.tree_step
    monkeypatch.setattr(medusa, "tree_step", step)
    monkeypatch.setattr(model, "hidden", hidden)
    result = TreeDecoder(model, SMALL_TREE, topk=10).generate(PROMPTS[0], DecodeConfig(max_new_tokens=30))
    assert result.tokens == greedy(base, PROMPTS[0], 30)
    assert checks == ["PreallocatedCache"]  # once, after the prefill; never inside a step
    assert len(steps) == result.forward_passes > 5
    assert [b - a for a, b in zip([0] + steps, steps)] == [1] * len(steps)  # one host read per step


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("choices,num_heads", [(SMALL_TREE, 3), ([list(p) for p in MC_SIM_7B_63], 4),
                                               (chain_choices(2), 2)])
def test_perfect_heads_accept_the_whole_depth_every_step(family, choices, num_heads):
    base = make_tiny_model(family)
    depth = max(len(p) for p in choices)
    steps = 6
    n = 1 + (depth + 1) * steps  # the prefill's token, then depth + 1 tokens per tree pass
    prompt = PROMPTS[0]
    continuation = greedy(base, prompt, n + num_heads + 2)
    model = LookupHeadsMedusa(base, num_heads, prompt + continuation)
    calls = count_backbone_calls(model)
    result = TreeDecoder(model, choices, topk=10).generate(prompt, DecodeConfig(max_new_tokens=n))
    assert result.tokens == continuation[:n]
    assert result.accepted_lengths == [depth + 1] * steps
    assert result.forward_passes == steps and len(calls) == steps + 1
    assert result.mean_accepted_tokens == depth + 1


def _perfect_llama(num_heads: int = 3, n: int = 40):
    base = make_tiny_model("llama")
    prompt = PROMPTS[0]
    continuation = greedy(base, prompt, n + num_heads + 2)
    return base, LookupHeadsMedusa(base, num_heads, prompt + continuation), prompt, continuation


@pytest.mark.parametrize("max_new_tokens,accepted", [(1, []), (2, [1]), (4, [3]), (5, [4]), (6, [4, 1]),
                                                     (9, [4, 4]), (12, [4, 4, 3])])
def test_max_new_tokens_is_exact(max_new_tokens, accepted):
    _, model, prompt, continuation = _perfect_llama()
    result = TreeDecoder(model, SMALL_TREE, topk=10).generate(prompt, DecodeConfig(max_new_tokens=max_new_tokens))
    assert result.tokens == continuation[:max_new_tokens]
    assert result.accepted_lengths == accepted
    assert result.stop_reason == "max_new_tokens"
    if not accepted:
        assert math.isnan(result.mean_accepted_tokens)


def test_eos_stops_mid_step_and_is_kept():
    base, model, prompt, continuation = _perfect_llama()
    j = next(i for i in range(6, len(continuation)) if continuation[i] not in continuation[:i] and i % 4 != 0)
    eos = continuation[j]
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=(eos,))
    medusa = TreeDecoder(model, SMALL_TREE, topk=10).generate(prompt, config)
    vanilla = VanillaDecoder(base).generate(prompt, config)
    assert medusa.tokens == vanilla.tokens == continuation[: j + 1]
    assert medusa.stop_reason == vanilla.stop_reason == "eos"
    check_counts(medusa)
    assert medusa.accepted_lengths[:-1] == [4] * (len(medusa.accepted_lengths) - 1)
    assert medusa.accepted_lengths[-1] == j % 4  # the step that met EOS is cut right after it


def test_eos_as_first_token():
    base, model, prompt, continuation = _perfect_llama()
    config = DecodeConfig(max_new_tokens=10, eos_token_ids=(continuation[0],))
    for decoder in (TreeDecoder(model, SMALL_TREE, topk=10), VanillaDecoder(base)):
        result = decoder.generate(prompt, config)
        assert result.tokens == continuation[:1] and result.forward_passes == 0 and result.stop_reason == "eos"


def test_stop_strings_cut_at_the_completing_token():
    base, model, prompt, continuation = _perfect_llama()
    tokenizer = CharTokenizer()
    j = 10
    stop = tokenizer.decode(continuation[j - 1 : j + 1])
    first = next(i for i in range(1, len(continuation)) if stop in tokenizer.decode(continuation[: i + 1]))
    config = DecodeConfig(max_new_tokens=30, stop_strings=(stop,))
    for decoder in (TreeDecoder(model, SMALL_TREE, topk=10, tokenizer=tokenizer),
                    VanillaDecoder(base, tokenizer=tokenizer)):
        result = decoder.generate(prompt, config)
        assert result.tokens == continuation[: first + 1]
        assert result.stop_reason == "stop_string"
        assert result.text == tokenizer.decode(result.tokens) and result.text.endswith(stop)
        check_counts(result)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        VanillaDecoder(base).generate(prompt, config)


# --- streaming ------------------------------------------------------------------------------------------------------

def test_token_streamer_receives_exactly_the_reply():
    _, model, prompt, continuation = _perfect_llama()
    streamer = Collector()
    result = TreeDecoder(model, SMALL_TREE, topk=10).generate(prompt, DecodeConfig(max_new_tokens=10), streamer)
    assert [t for chunk in streamer.chunks for t in chunk] == result.tokens == continuation[:10]
    assert [len(c) for c in streamer.chunks] == [1, 4, 4, 1] and streamer.ended == 1


def test_hf_text_streamer_prints_the_reply(capsys):
    base, model, prompt, continuation = _perfect_llama()
    tokenizer = CharTokenizer()
    for decoder in (TreeDecoder(model, SMALL_TREE, topk=10), VanillaDecoder(base)):
        decoder.generate(prompt, DecodeConfig(max_new_tokens=9), TextStreamer(tokenizer, skip_prompt=True))
        assert capsys.readouterr().out == tokenizer.decode(continuation[:9]) + "\n"


# --- errors ---------------------------------------------------------------------------------------------------------

def test_errors_before_decoding():
    base = make_tiny_model("gpt2")  # 256 positions
    model = random_medusa(base)
    decoders = (TreeDecoder(model, SMALL_TREE, topk=10), VanillaDecoder(base))
    for decoder in decoders:
        with pytest.raises(ValueError, match="empty"):
            decoder.generate([], DecodeConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match="empty"):
            decoder.generate(torch.zeros(1, 0, dtype=torch.long), DecodeConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match="batch 2"):
            decoder.generate(torch.ones(2, 3, dtype=torch.long), DecodeConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match=r"max_new_tokens \(252\).*at most 251"):
            decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=252))
    # Right at the limit, the tree's deeper nodes run past the last position and are clamped, never kept.
    result = decoders[0].generate(PROMPTS[0], DecodeConfig(max_new_tokens=251))
    assert result.tokens == decoders[1].generate(PROMPTS[0], DecodeConfig(max_new_tokens=251)).tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        DecodeConfig(max_new_tokens=3, top_p=0.0)


def test_invalid_trees_and_settings_are_named():
    model = random_medusa(make_tiny_model("llama"))
    with pytest.raises(ValueError, match=r"\[1, 0\].*prefix \[1\] is missing"):
        TreeDecoder(model, [[0], [1, 0]])
    with pytest.raises(ValueError, match=r"\[0, 0, 0, 0\].*exceeds num_heads=3"):
        TreeDecoder(model, chain_choices(4))
    with pytest.raises(ValueError, match=r"\[12\].*topk=10"):
        TreeDecoder(model, [[12]], topk=10)
    with pytest.raises(ValueError, match="topk must be an int in \\[1, 97\\]"):
        TreeDecoder(model, [[0]], topk=98)
    with pytest.raises(ValueError, match="acceptance must be one of"):
        TreeDecoder(model, [[0]], acceptance="optimistic")
    with pytest.raises(ValueError, match="acceptance='greedy' needs temperature=0"):
        TreeDecoder(model, [[0]], acceptance="greedy").generate(PROMPTS[0], DecodeConfig(max_new_tokens=3,
                                                                                         temperature=0.7))
    with pytest.raises(ValueError, match="typical"):
        TreeDecoder(model, [[0]], acceptance="typical").generate(
            PROMPTS[0], DecodeConfig(max_new_tokens=3, temperature=0.7, top_p=0.9))


def test_unsupported_attention_layouts_are_refused_at_construction():
    hybrid = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=None, sliding_window=8)
    base = transformers.AutoModelForCausalLM.from_config(hybrid, attn_implementation="eager").eval()
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        TreeDecoder(SpeculativeModel(base, new_heads_for(base, 2)), [[0]])
    llama = make_tiny_model("llama")
    llama.config._attn_implementation = "flash_attention_2"  # a config value, as a flash-attention load sets it
    with pytest.raises(NotImplementedError, match="flash_attention_2"):
        TreeDecoder(SpeculativeModel(llama, new_heads_for(llama, 2)), [[0]])


def test_sliding_window_model_within_its_window():
    base = make_tiny_model("mistral", sliding_window=48)
    decoder = TreeDecoder(random_medusa(base), SMALL_TREE, topk=10)
    assert decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=40)).tokens == greedy(base, PROMPTS[0], 40)
    with pytest.raises(ValueError, match="sliding window.*max_new_tokens"):
        decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=41))


# --- several prompts in one batch -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_batched_greedy_equals_each_prompt_alone(family):
    base = make_tiny_model(family)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]  # lengths 9, 5, 2: left padding
    expected = [greedy(base, p, 30) for p in prompts]
    vanilla = VanillaDecoder(base).generate_batch(prompts, DecodeConfig(max_new_tokens=30))
    assert [r.tokens for r in vanilla] == expected
    model = random_medusa(base)
    calls = count_backbone_calls(model)
    medusa = TreeDecoder(model, SMALL_TREE, topk=10).generate_batch(prompts, DecodeConfig(max_new_tokens=30))
    assert [r.tokens for r in medusa] == expected
    for r in medusa:
        check_counts(r)
    # one shared pass per step, while any row is still decoding
    assert len(calls) == 1 + max(r.forward_passes for r in medusa)
    assert len({r.forward_passes for r in medusa}) > 1  # rows accepted differently and finished at different steps


def test_batched_rows_stop_on_their_own():
    base, model, prompt, continuation = _perfect_llama()
    other = PROMPTS[1]
    eos = continuation[6]
    config = DecodeConfig(max_new_tokens=20, eos_token_ids=(eos,))
    alone = [TreeDecoder(model, SMALL_TREE, topk=10).generate(p, config) for p in (prompt, other)]
    batch = TreeDecoder(model, SMALL_TREE, topk=10).generate_batch([prompt, other], config)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.accepted_lengths for r in batch] == [r.accepted_lengths for r in alone]
    assert batch[0].tokens == continuation[: continuation.index(eos) + 1] and batch[0].stop_reason == "eos"
    with pytest.raises(ValueError, match=r"prompts\[1\]: input_ids is empty"):
        TreeDecoder(model, SMALL_TREE, topk=10).generate_batch([prompt, []], config)
    with pytest.raises(ValueError, match="streamer needs a single prompt"):
        from inference.decoders.batching import Replies
        Replies(2, config, streamer=Collector())


def test_batched_speculative_sampling_is_reproducible():
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_medusa(base), SMALL_TREE, topk=10, acceptance="speculative")
    config = DecodeConfig(max_new_tokens=15, temperature=0.9, seed=5)
    first = decoder.generate_batch(list(PROMPTS), config)
    assert [r.tokens for r in decoder.generate_batch(list(PROMPTS), config)] == [r.tokens for r in first]
    assert all(len(r.tokens) == 15 for r in first)


# --- other acceptance rules -----------------------------------------------------------------------------------------

def random_heads(head_type: str, base: torch.nn.Module, num_heads: int = 3, seed: int = 0,
                 **options) -> SpeculativeModel:
    """Random heads of any registered drafter type on ``base`` (every rule of the decoder serves every type): every
    parameter but the projections (copied from the base lm_head) perturbed by N(0, 0.3^2), so they disagree with the
    base often and many drafts are rejected. ``options``: the type's own (Hydra's ``combine``)."""
    if "feature_layers" in drafter_type(head_type).option_names and "feature_layers" not in options \
            and count_layers(base.config) < 7:  # too shallow for vLLM's default taps: the input of every layer
        options["feature_layers"] = tuple(range(3))
    heads = new_heads_for(base, num_heads, head_type=head_type, **options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name != "lm_head_weight":
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    return SpeculativeModel(base, heads)


@pytest.mark.parametrize("head_type", head_types())  # every type in the drafter catalog
@pytest.mark.parametrize("acceptance", ["typical", "speculative"])
def test_sampling_rules_are_greedy_at_temperature_zero(acceptance, head_type):
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_heads(head_type, base), SMALL_TREE, topk=10, acceptance=acceptance)
    assert decoder.generate(PROMPTS[2], DecodeConfig(max_new_tokens=30)).tokens == greedy(base, PROMPTS[2], 30)


@pytest.mark.parametrize("head_type", head_types())  # every type in the drafter catalog
@pytest.mark.parametrize("acceptance", ["typical", "speculative"])
def test_sampling_rules_are_reproducible_by_seed(acceptance, head_type):
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_heads(head_type, base), SMALL_TREE, topk=10, acceptance=acceptance)
    runs = [decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=20, temperature=0.8, seed=s)) for s in (3, 3, 4)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    for r in runs:
        assert len(r.tokens) == 20 and all(0 <= t < 97 for t in r.tokens)
        check_counts(r)


def test_perfect_heads_typical_acceptance_at_low_temperature_accepts_everything():
    """One-hot heads equal to the greedy path; at temperature 1e-4 the target is one-hot on it too (the tiny model's
    top-2 logit gaps are >= 0.005)."""
    _, model, prompt, continuation = _perfect_llama()
    result = TreeDecoder(model, SMALL_TREE, topk=10, acceptance="typical").generate(
        prompt, DecodeConfig(max_new_tokens=13, temperature=1e-4, seed=0))
    assert result.accepted_lengths == [4, 4, 4]
    assert aggregate_mean_accepted_tokens([result, result]) == 4.0


@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution_of_the_first_two_tokens():
    """Chi-square of the first two sampled tokens against the model's exact joint distribution (V = 8, 64 cells).

    It has power: run with Medusa's lossy typical acceptance instead, it measured chi-square 3057 on 24 degrees of
    freedom (p = 0).
    """
    base = make_tiny_model("llama", vocab_size=8, initializer_range=0.3, num_hidden_layers=1)
    model = random_medusa(base, num_heads=2)
    prompt = [1, 5, 3]
    choices = [[0], [1], [2], [0, 0], [1, 0]]
    with torch.no_grad():
        p1 = torch.softmax(base(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(base(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
                          for a in range(8)])  # [8, 8], row a: next-token distribution after a
        hidden = base.base_model(torch.tensor([prompt])).last_hidden_state[:, -1]
        drafted = model.head_logits(hidden)[0, 0].topk(3).indices  # head 0's candidates, fixed by the prompt
    joint = p1[:, None] * p2
    # The drafts hold a fair share of the mass: both acceptance and the residual resampling are exercised.
    assert 0.2 < float(joint[:, drafted].sum()) < 0.8

    decoder = TreeDecoder(model, choices, topk=3, acceptance="speculative")
    samples = 1000
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for seed in range(samples):
        tokens = decoder.generate(prompt, DecodeConfig(max_new_tokens=2, temperature=1.0, seed=seed)).tokens
        counts[tokens[0], tokens[1]] += 1
    p_value, chi2, dof = chi_square(counts, joint * samples)
    assert p_value > 1e-3, (chi2, dof)


# --- pieces ---------------------------------------------------------------------------------------------------------

def test_tree_attention_mask_values():
    tree = build_tree_buffers([[0], [1], [0, 0]], num_heads=2, topk=2)
    past_valid = torch.tensor([[True, True], [False, True]])  # row 1: a padding slot
    mask = tree_attention_mask(tree.attn_mask, past_valid, dtype=torch.float32)
    low = torch.finfo(torch.float32).min
    assert mask.shape == (2, 1, 4, 6)
    allowed = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]])
    assert torch.equal(mask[0, 0], torch.where(allowed.bool(), 0.0, low))
    assert torch.equal(tree_attention_mask(tree.attn_mask, 2, torch.float32), mask[:1])
    allowed[:, 0] = 0
    assert torch.equal(mask[1, 0], torch.where(allowed.bool(), 0.0, low))


def test_default_medusa_choices_fit_the_heads():
    choices = default_medusa_choices(num_heads=2, topk=5)
    assert max(len(p) for p in choices) == 2 and max(max(p) for p in choices) == 4
    tree = build_tree_buffers(choices, num_heads=2, topk=5)
    assert tree.num_nodes == len(choices) + 1


def test_chat_generate_fills_eos_and_text():
    base, model, _, _ = _perfect_llama()
    tokenizer = CharTokenizer()
    prompt = chat_prompt_ids(tokenizer, "NJ")  # [1, 46, 42]
    assert prompt == [1, ord("N") - 32, ord("J") - 32]
    assert eos_ids(tokenizer, SimpleNamespace(eos_token_id=[5, 2])) == (5, 2)
    result = generate(VanillaDecoder(base), tokenizer, "NJ", DecodeConfig(max_new_tokens=50))
    expected = greedy(base, prompt, 50)
    cut = expected.index(2) + 1 if 2 in expected else 50
    assert result.tokens == expected[:cut]
    assert result.text == tokenizer.decode(result.tokens)
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])


def test_a_shallow_tree_reads_only_its_heads():
    base = make_tiny_model("llama")
    decoder = TreeDecoder(SpeculativeModel(base, new_heads_for(base, num_heads=4)), [[0], [1], [0, 0]], topk=2)
    assert decoder.tree.num_heads == 2 and decoder.tree.max_depth == 2
    with pytest.raises(ValueError, match="exceeds num_heads=4"):
        TreeDecoder(SpeculativeModel(base, new_heads_for(base, num_heads=4)), [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                                                             [0, 0, 0, 0, 0]], topk=2)
