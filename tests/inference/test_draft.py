"""Draft-model speculative decoding: greedy output equal to plain greedy decoding, exact acceptance counts, the
target's distribution under speculative sampling, the self-layers draft, and clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.decoders.base import DecodeConfig
from inference.decoders.draft import DraftDecoder, pass_layout
from inference.decoders.vanilla import VanillaDecoder
from inference.draft_loading import DraftConfig, check_draft_compatible, load_draft, self_layer_draft
from inference.proposers import AuxBranch, DraftModelProposer, Proposal, Proposer, empty_proposal
from inference.registry import register_decoder_schemas
from medusa_train.cli.app import register_shared_schemas
from medusa_train.config.schema import ModelConfig
from inference.conf import CONF_DIR
from medusa_train.files.paths import assets_dir
from tests.conftest import chi_square, make_tiny_model, make_tiny_tokenizer

register_shared_schemas()  # draft/ files hold model/ configs: the shared schemas and resolvers
register_decoder_schemas()  # ... and extend schema/draft/base

PROMPTS = ([1, 5, 9, 33, 20], [1, 70], [1, 44, 12, 90, 3, 3, 61, 8, 17])
STORY_PROMPTS = ("Once upon a time", "Lily and Tom went to the park", "The dog")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine run far faster on one thread; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stories() -> tuple[torch.nn.Module, object]:
    """stories260K (a real 260K-parameter Llama, 5 layers) and its tokenizer, fp32."""
    from medusa_train.loading.base import load_base_model

    path = assets_dir() / "stories260K" / "stories260K.bin"
    return load_base_model(ModelConfig(name_or_path=str(path), format="llama2c"))


def varied_model(family: str, **overrides) -> torch.nn.Module:
    """A tiny model whose greedy continuations vary (the default init makes them repeat one token)."""
    return make_tiny_model(family, initializer_range=0.3, **overrides)


def greedy(model: torch.nn.Module, prompt: list[int], n: int, **config) -> list[int]:
    return VanillaDecoder(model).generate(prompt, DecodeConfig(max_new_tokens=n, **config)).tokens


def count_calls(model: torch.nn.Module) -> list[int]:
    """Grows by one per forward call of ``model`` (a hook; the test's models are thrown away afterwards)."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def check_counts(result) -> None:
    assert len(result.tokens) == 1 + sum(result.accepted_lengths)
    assert len(result.accepted_lengths) == result.forward_passes
    assert all(n >= 1 for n in result.accepted_lengths)


# --- greedy output = plain greedy output ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_equals_vanilla_with_self_layer_and_separate_drafts(family):
    target = varied_model(family)
    drafts = {"self_layers": self_layer_draft(target, 1),
              "separate": make_tiny_model(family, seed=1, initializer_range=0.3)}  # a bad draft: many rejections
    for prompt in PROMPTS:
        expected = greedy(target, prompt, 24)
        for name, draft in drafts.items():
            settings = ((1, "constant"), (4, "constant"), (2, "heuristic"))
            for k, schedule in settings if name == "self_layers" else ((3, "constant"),):
                result = DraftDecoder(target, draft, k, schedule).generate(prompt, DecodeConfig(max_new_tokens=24))
                assert result.tokens == expected, (family, name, k, schedule, prompt)
                check_counts(result)
                assert result.stop_reason == "max_new_tokens"


def test_greedy_equals_vanilla_on_stories260k(stories):
    model, tokenizer = stories
    draft = self_layer_draft(model, 2)
    decoder = DraftDecoder(model, draft, 4, tokenizer=tokenizer)
    for text in STORY_PROMPTS:
        ids = tokenizer(text).input_ids
        result = decoder.generate(ids, DecodeConfig(max_new_tokens=32))
        assert result.tokens == greedy(model, ids, 32)
        assert result.text == tokenizer.decode(result.tokens, skip_special_tokens=True)
        check_counts(result)


def test_eos_ends_the_reply_mid_step_as_vanilla_does():
    target = varied_model("llama")
    continuation = greedy(target, PROMPTS[0], 30)
    j = next(i for i in range(3, 30) if continuation[i] not in continuation[:i])
    config = DecodeConfig(max_new_tokens=30, eos_token_ids=(continuation[j],))
    result = DraftDecoder(target, target, 4).generate(PROMPTS[0], config)
    assert result.tokens == VanillaDecoder(target).generate(PROMPTS[0], config).tokens == continuation[: j + 1]
    assert result.stop_reason == "eos"
    check_counts(result)


# --- counts -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_identical_to_target_accepts_all_k_tokens(family, k):
    target = varied_model(family)
    steps = 4
    n = 1 + (k + 1) * steps  # the prefill's token, then K accepted + 1 bonus per pass
    expected = greedy(target, PROMPTS[2], n)
    calls = count_calls(target)
    result = DraftDecoder(target, target, k).generate(PROMPTS[2], DecodeConfig(max_new_tokens=n))
    assert result.tokens == expected
    assert result.accepted_lengths == [k + 1] * steps
    assert result.mean_accepted_tokens == k + 1
    # the target model is also the draft here: 1 prefill + `steps` verifications, and K draft calls per step
    assert len(calls) == 1 + steps + k * steps


def test_heuristic_schedule_grows_k_by_two_after_full_accepts():
    target = varied_model("llama")
    # K = 1, 3, 5, 7: each pass accepts all K and emits K + 1 tokens; the last is cut by max_new_tokens.
    n = 1 + 2 + 4 + 6 + 3
    result = DraftDecoder(target, target, 1, "heuristic").generate(PROMPTS[0], DecodeConfig(max_new_tokens=n))
    assert result.accepted_lengths == [2, 4, 6, 3]
    assert result.tokens == greedy(target, PROMPTS[0], n)


def test_heuristic_schedule_shrinks_k_after_a_rejection():
    target = varied_model("llama")
    proposer = DraftModelProposer(target, DecodeConfig(max_new_tokens=50), None, 4, "heuristic")
    sequence = list(PROMPTS[0])
    assert proposer.propose(sequence, 10).tokens.shape == (1, 4)
    proposer.update(sequence, 2, None)  # 2 of 4 accepted
    assert proposer.propose(sequence, 10).tokens.shape == (1, 3)
    proposer.update(sequence, 3, None)  # all 3 accepted
    assert proposer.propose(sequence, 10).tokens.shape == (1, 5)
    assert proposer.propose(sequence, 2).tokens.shape == (1, 2)  # capped by the room left
    assert proposer.propose(sequence, 0).empty


def test_confidence_threshold_stops_drafting_early():
    target = varied_model("llama")
    draft = make_tiny_model("llama", seed=1)  # a random draft: its most likely token has probability ~ 1/V
    sequence = list(PROMPTS[0])
    config = DecodeConfig(max_new_tokens=50)
    assert DraftModelProposer(draft, config, None, 4).propose(sequence, 10).tokens.shape == (1, 4)
    assert DraftModelProposer(draft, config, None, 4, confidence_threshold=0.5).propose(sequence, 10).tokens.shape \
        == (1, 1)  # the first token is below 0.5: it is kept, and drafting stops
    result = DraftDecoder(target, draft, 4, confidence_threshold=0.5).generate(sequence, config)
    assert result.tokens == greedy(target, sequence, 50)
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\)"):
        DraftDecoder(target, draft, 4, confidence_threshold=1.0)


def test_empty_proposal_falls_back_to_plain_decoding():
    target = varied_model("llama")
    draft = self_layer_draft(target, 1)
    expected = greedy(target, PROMPTS[0], 2)
    draft_calls, target_calls = count_calls(draft), count_calls(target)
    # max_new_tokens=2: after the prefill's token only the bonus token fits, so nothing is drafted.
    result = DraftDecoder(target, draft, 4).generate(PROMPTS[0], DecodeConfig(max_new_tokens=2))
    assert result.tokens == expected
    assert result.accepted_lengths == [1]
    assert len(draft_calls) == 0 and len(target_calls) == 2
    assert isinstance(DraftModelProposer(draft, DecodeConfig(max_new_tokens=2), None, 3), Proposer)


def test_pass_layout_of_root_aux_and_two_chains():
    aux = AuxBranch(tokens=torch.tensor([7, 8]), offsets=torch.tensor([1, 2]),
                    mask=torch.tensor([[True, False], [True, True]]), logits_at=torch.tensor([1]))
    proposal = Proposal(tokens=torch.tensor([[3, 4], [5, 6]]), aux=aux)
    visible, offsets = pass_layout(proposal, torch.device("cpu"))
    #                         root a1 a2 c00 c01 c10 c11
    expected = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0, 0],
                             [1, 0, 0, 1, 1, 0, 0],
                             [1, 0, 0, 0, 0, 1, 0],
                             [1, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible, expected)
    assert offsets.tolist() == [0, 1, 2, 1, 2, 1, 2]
    assert empty_proposal().empty and empty_proposal().tokens.shape == (0, 0)


# --- speculative sampling keeps the target distribution -----------------------------------------------------------

@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution():
    """Chi-square of the 2nd and 3rd tokens (both decided by speculative steps: accepted, recovered, bonus, and the
    empty proposal at the end) against the target's exact joint distribution, marginalised over the 1st token.

    The draft is another random model; sampling from the draft instead would fail (checked via the distance)."""
    v = 4
    target = make_tiny_model("llama", vocab_size=v, initializer_range=0.3, num_hidden_layers=1)
    draft = make_tiny_model("llama", seed=3, vocab_size=v, initializer_range=0.3, num_hidden_layers=1)
    prompt = [1, 3, 2]

    def joint_of_tokens_2_and_3(model: torch.nn.Module) -> torch.Tensor:
        def next_probs(seq: list[int]) -> torch.Tensor:
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

        with torch.no_grad():
            joint = torch.zeros(v, v, dtype=torch.float64)
            p1 = next_probs(prompt)
            for a in range(v):
                p2 = next_probs(prompt + [a])
                for b in range(v):
                    joint[b] += p1[a] * p2[b] * next_probs(prompt + [a, b])
        return joint  # [V, V]: P(token 2 = b, token 3 = c)

    expected_joint = joint_of_tokens_2_and_3(target)
    assert float((expected_joint - joint_of_tokens_2_and_3(draft)).abs().sum()) / 2 > 0.2  # the test has power

    decoder = DraftDecoder(target, draft, 2)
    samples = 800
    counts = torch.zeros(v, v, dtype=torch.float64)
    for seed in range(samples):
        tokens = decoder.generate(prompt, DecodeConfig(max_new_tokens=3, temperature=1.0, seed=seed)).tokens
        counts[tokens[1], tokens[2]] += 1
    p_value, chi2, dof = chi_square(counts, expected_joint * samples)
    assert p_value > 1e-3, (chi2, dof)


def test_sampling_is_reproducible_by_seed_and_counts_hold():
    target = varied_model("llama")
    decoder = DraftDecoder(target, self_layer_draft(target, 1), 3)
    runs = [decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=s))
            for s in (5, 5, 6)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    for r in runs:
        assert len(r.tokens) == 20
        check_counts(r)


# --- the self-layers draft ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma", "gpt_neox"])
def test_self_layer_draft_shares_weights_and_exits_early(family):
    layers = {"gpt2": {"n_layer": 3}}.get(family, {"num_hidden_layers": 3})
    target = make_tiny_model(family, **layers)
    draft = self_layer_draft(target, 2)
    target_storage = {t.data_ptr() for t in target.parameters()}
    assert all(p.data_ptr() in target_storage for p in draft.parameters())
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 3
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        hidden = target(x, output_hidden_states=True).hidden_states[2]  # after layer 2 (0 = embeddings)
        base = target.base_model
        norm = next(getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(base, n))
        expected = target.get_output_embeddings()(norm(hidden))
        assert torch.allclose(draft(x).logits, expected, atol=1e-5)


def test_self_layer_draft_rejects_bad_layer_counts():
    target = make_tiny_model("llama")  # 2 layers
    for bad in (0, 2, -1, 1.5):
        with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 2\)"):
            self_layer_draft(target, bad)


# --- configs and errors -------------------------------------------------------------------------------------------

def test_draft_configs_compose_and_load(stories):
    target = make_tiny_model("llama", num_hidden_layers=3)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        self_layers = compose("evaluate", overrides=["draft=self_layers", "draft.num_layers=2"]).draft
        separate = compose("evaluate", overrides=["draft=model"]).draft
    draft, draft_tokenizer = load_draft(self_layers, target)
    assert draft.config.num_hidden_layers == 2 and draft_tokenizer is None
    assert self_layers.num_draft_tokens == 5 and self_layers.schedule == "constant"
    assert separate.kind == "model" and separate.model.format == "llama2c"
    with pytest.raises(ValueError, match="draft vocabulary size 512 != target vocabulary size 97"):
        load_draft(separate, target)  # stories260K speaks another vocabulary than the tiny target
    model, tokenizer = stories
    same, same_tokenizer = load_draft(separate, model, tokenizer)  # stories260K drafting for itself
    assert same_tokenizer.get_vocab() == tokenizer.get_vocab()
    ids = tokenizer(STORY_PROMPTS[0]).input_ids
    result = DraftDecoder(model, same, 3, tokenizer=tokenizer, draft_tokenizer=same_tokenizer).generate(
        ids, DecodeConfig(max_new_tokens=9))
    assert result.accepted_lengths == [4, 4]


@pytest.mark.parametrize("cfg,message", [
    (dict(kind="tiny"), "draft.kind must be one of"),
    (dict(kind="self_layers", num_layers=0), "draft.num_layers"),
    (dict(kind="model"), "draft.kind=model needs draft.model"),
    (dict(num_draft_tokens=0), r"draft.num_draft_tokens \(K, tokens drafted per step\) must be an int >= 1"),
    (dict(schedule="adaptive"), "draft.schedule must be one of"),
])
def test_draft_config_errors_name_the_field(cfg, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**cfg).validate()


def test_bad_input_is_refused_with_the_field_named():
    target = make_tiny_model("llama")
    for k in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=r"num_draft_tokens \(K, tokens drafted per step\) must be an int >= 1"):
            DraftDecoder(target, target, k)
    with pytest.raises(ValueError, match="schedule must be one of"):
        DraftDecoder(target, target, 2, schedule="adaptive")
    other_vocab = make_tiny_model("llama", vocab_size=50)
    with pytest.raises(ValueError, match="draft vocabulary size 50 != target vocabulary size 97"):
        DraftDecoder(target, other_vocab)
    with pytest.raises(ValueError, match="draft tokenizer differs from the target tokenizer"):
        check_draft_compatible(target, target, make_tiny_tokenizer(97), make_tiny_tokenizer(90))
    with pytest.raises(TypeError, match="draft"):
        DraftDecoder(target, object())
    small = make_tiny_model("gpt2")  # 256 positions
    with pytest.raises(ValueError, match=r"max_new_tokens \(300\)"):
        DraftDecoder(small, self_layer_draft(make_tiny_model("gpt2", n_layer=3), 1)).generate(
            PROMPTS[0], DecodeConfig(max_new_tokens=300))
