"""EAGLE-3 drafters in the tree decoder: greedy output equals plain greedy decoding (static and dynamic trees, one row
and a batch), the drafter's chain equals an independent cache-free reference, a drafter that is always right
accepts the whole depth every step, and the sampling rules are greedy at temperature 0."""

from __future__ import annotations

import pytest
import torch

from inference.decoders import DecodeConfig, TreeDecoder
from medusa_train.drafters.eagle3.proposer import Eagle3TreeDrafter
from medusa_train.models.features import layer_feature
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.tree.buffers import SMALL_TREE_15, chain_choices
from medusa_train.tree.dynamic import DynamicTree, dynamic_tree
from tests.conftest import FAMILIES, VOCAB, make_tiny_model
from tests.inference.test_decoders import PROMPTS, check_counts, greedy, random_heads, random_medusa

SMALL_TREE = [list(p) for p in SMALL_TREE_15]  # depth 3, 16 nodes
DYNAMIC = (4, 3, 12)  # depth, topk, total

pytestmark = pytest.mark.usefixtures("one_thread")


def random_eagle3(base: torch.nn.Module, num_steps: int = 4, seed: int = 0) -> SpeculativeModel:
    """A random EAGLE-3 drafter (``random_heads``: the taps (0, 1, 2) of a two-layer target, vLLM's defaults on a
    deeper one)."""
    return random_heads("eagle3", base, num_steps, seed)


def decoders(model: SpeculativeModel, acceptance: str = "greedy") -> dict[str, TreeDecoder]:
    return {"static": TreeDecoder(model, SMALL_TREE, topk=10, acceptance=acceptance),
            "dynamic": TreeDecoder(model, None, acceptance=acceptance, dynamic_tree=DYNAMIC)}


class Recorder:
    """Wraps a drafter: each original batch row's drafted node tokens, step by step (rows leave by ``select``)."""

    def __init__(self, drafter, rows: int) -> None:
        self.drafter, self.active = drafter, list(range(rows))
        self.drafts: list[list[list[int]]] = [[] for _ in range(rows)]
        self.trees: list[int] = []

    def start(self, *args) -> None:
        self.drafter.start(*args)

    def _record(self, nodes: torch.Tensor) -> None:
        for row, tokens in zip(self.active, nodes.tolist()):
            self.drafts[row].append(tokens)

    def draft(self, root, tree):
        nodes = self.drafter.draft(root, tree)
        self._record(nodes)
        return nodes

    def draft_dynamic(self, root, shape):
        nodes, tree = self.drafter.draft_dynamic(root, shape)
        self._record(nodes)
        self.trees.append(tree.num_nodes)
        return nodes, tree

    def accept(self, *args) -> None:
        self.drafter.accept(*args)

    def select(self, keep: torch.Tensor) -> None:
        self.active = [self.active[k] for k in keep.tolist()]
        self.drafter.select(keep)


def reference_chain(model: SpeculativeModel, sequence: list[int], last: int, depth: int) -> list[int]:
    """The drafter's top-1 chain after committed positions ``0..last`` of ``sequence`` (``sequence[last + 1]`` the
    root), by ``Eagle3Drafter.forward`` over the whole sequence, causal and without a cache: position p reads the
    fused target feature at p (the drafter's own output at drafted positions) and the embedding of token p + 1."""
    heads = model.heads
    features, _ = model.features(torch.tensor([sequence[: last + 1]]))
    hidden = heads.fuse([features[layer_feature(i)] for i in heads.spec.feature_layers])  # [1, last + 1, H]
    following = list(sequence[1: last + 2])
    drafts = []
    for _ in range(depth):
        length = hidden.shape[1]
        logits, out = heads(hidden, model.embed(torch.tensor([following])), torch.arange(length)[None])
        token = int(heads.to_base_tokens(logits[0, -1].argmax()))
        drafts.append(token)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        following.append(token)
    return drafts


# --- greedy = plain greedy --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,layers", [*((f, 2) for f in sorted(FAMILIES)), ("llama", 8), ("qwen2", 8)])
def test_eagle3_greedy_equals_plain_greedy_static_and_dynamic(family, layers):
    base = make_tiny_model(family, num_hidden_layers=layers) if family != "gpt2" else make_tiny_model(family)
    model = random_eagle3(base)
    for kind, decoder in decoders(model).items():
        assert isinstance(decoder.drafter, Eagle3TreeDrafter)
        for prompt in PROMPTS:
            result = decoder.generate(prompt, DecodeConfig(max_new_tokens=30))
            assert result.tokens == greedy(base, prompt, 30), (family, kind, prompt)
            check_counts(result)
        batch = decoder.generate_batch(list(PROMPTS), DecodeConfig(max_new_tokens=30))
        assert [r.tokens for r in batch] == [greedy(base, p, 30) for p in PROMPTS], (family, kind)


@pytest.mark.parametrize("acceptance", ["typical", "speculative"])
def test_eagle3_sampling_rules_are_greedy_at_temperature_zero(acceptance):
    base = make_tiny_model("llama")
    for kind, decoder in decoders(random_eagle3(base), acceptance).items():
        for prompt in PROMPTS:
            assert decoder.generate(prompt, DecodeConfig(max_new_tokens=25)).tokens == greedy(base, prompt, 25), kind


def test_eagle3_speculative_sampling_over_a_dynamic_tree_is_reproducible_by_seed():
    base = make_tiny_model("llama")
    decoder = decoders(random_eagle3(base), "speculative")["dynamic"]
    runs = [decoder.generate(PROMPTS[0], DecodeConfig(max_new_tokens=20, temperature=1.0, seed=s)).tokens
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and len(runs[0]) == 20


# --- the drafter's cache, masks and positions ----------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eagle3_chain_drafts_equal_a_cache_free_reference_single_and_batched(family):
    base = make_tiny_model(family)
    model = random_eagle3(base)
    depth = 3
    decoder = TreeDecoder(model, chain_choices(depth), topk=1)
    single = []
    for prompt in PROMPTS:
        recorder = Recorder(Eagle3TreeDrafter(model), 1)
        decoder.drafter = recorder
        result = decoder.generate(prompt, DecodeConfig(max_new_tokens=24))
        sequence = prompt + result.tokens
        done = 0
        for step, nodes in enumerate(recorder.drafts[0]):
            last = len(prompt) + done - 1
            assert nodes[0] == sequence[last + 1]
            assert nodes[1:] == reference_chain(model, sequence, last, depth), (family, prompt, step)
            done += result.accepted_lengths[step]
        assert len(recorder.drafts[0]) == result.forward_passes > 5
        single.append(recorder.drafts[0])
    recorder = Recorder(Eagle3TreeDrafter(model), len(PROMPTS))
    decoder.drafter = recorder
    decoder.generate_batch(list(PROMPTS), DecodeConfig(max_new_tokens=24))
    assert recorder.drafts == single  # every row drafts in the batch (left padding, uneven accepts) as alone


def test_dynamic_tree_keeps_the_best_total_nodes_as_a_valid_tree():
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_eagle3(base), None, dynamic_tree=DYNAMIC)
    recorder = Recorder(decoder.drafter, 1)
    decoder.drafter = recorder
    result = decoder.generate(PROMPTS[2], DecodeConfig(max_new_tokens=20))
    assert result.tokens == greedy(base, PROMPTS[2], 20)
    assert recorder.trees == [DYNAMIC[2] + 1] * result.forward_passes  # total nodes plus the root, every step
    drafter = Eagle3TreeDrafter(decoder.model)  # one step by hand: the kept nodes are the best by cumulative value
    ids = torch.tensor([PROMPTS[2]])
    features, _ = decoder.model.features(ids)
    drafter.start(features, ids, torch.ones_like(ids, dtype=torch.bool))
    tokens, tree = drafter.draft_dynamic(torch.tensor([5]), DynamicTree(2, 3, 4))
    assert tree.num_nodes == 5 and tree.max_depth <= 2 and tokens.shape == (1, 5)
    assert all(len(p) == 1 or p[:-1] in tree.paths for p in tree.paths)
    # depth 1 holds the root's top-3; with total 4 at most one depth-2 node, a child of the best depth-1 node
    assert [p for p in tree.paths if len(p) == 1] in ([(0,), (1,), (2,)], [(0,), (1,)], [(0,)])
    assert all(p[0] == 0 for p in tree.paths if len(p) == 2)


def test_dynamic_tree_settings_are_checked_by_field():
    assert dynamic_tree((3, 2, 5)) == DynamicTree(3, 2, 5) == dynamic_tree({"depth": 3, "topk": 2, "total": 5})
    with pytest.raises(ValueError, match=r"dynamic_tree.total=9 exceeds the 6 nodes"):
        DynamicTree(2, 2, 9)
    with pytest.raises(ValueError, match=r"dynamic_tree.topk must be a positive int"):
        DynamicTree(2, 0, 1)
    base = make_tiny_model("llama")
    with pytest.raises(ValueError, match=r"dynamic_tree: MedusaTreeDrafter drafts a static tree only"):
        TreeDecoder(random_medusa(base), None, dynamic_tree=(3, 2, 5))
    with pytest.raises(ValueError, match=r"dynamic_tree.topk must be at most"):
        TreeDecoder(random_eagle3(base), None, dynamic_tree=(2, VOCAB + 1, 3))


# --- a drafter that is always right on the true path ----------------------------------------------------------------

def make_oracle(model: SpeculativeModel, sequences: list[list[int]]) -> None:
    """Patch the drafter's logits: at position p (a row's own, 0 at its first real token) it predicts the row's true
    token p + 2 when the token it reads (recovered from its embedding) is the true token p + 1, else a wrong token.
    The row is recovered from the batch index while the batch holds every row (the tests below finish together)."""
    heads = model.heads
    table = model.embed(torch.arange(VOCAB))  # [V, H]
    forward = heads.forward

    def oracle(hidden, embeds, position_ids, mask=None, cache=None):
        logits, out = forward(hidden, embeds, position_ids, mask, cache)
        tokens = torch.cdist(embeds.reshape(-1, embeds.shape[-1]), table).argmin(-1).view(embeds.shape[:2])
        fake = torch.zeros_like(logits)
        for b in range(logits.shape[0]):
            seq = sequences[b]
            for t in range(logits.shape[1]):
                p = int(position_ids[b, t])
                right = seq[min(p + 2, len(seq) - 1)]
                on_path = p + 1 < len(seq) and int(tokens[b, t]) == seq[p + 1]
                fake[b, t, right if on_path else (right + 1) % VOCAB] = 10.0
        return fake, out

    heads.forward = oracle


@pytest.mark.parametrize("kind", ["static", "chain", "dynamic"])
def test_an_always_right_drafter_accepts_the_whole_depth_every_step(kind):
    base = make_tiny_model("llama")
    model = random_eagle3(base, num_steps=4)
    depth, steps = {"static": 3, "chain": 4, "dynamic": DYNAMIC[0]}[kind], 5
    n = 1 + (depth + 1) * steps
    prompts = [PROMPTS[0], PROMPTS[2]]
    sequences = [p + greedy(base, p, n + depth + 2) for p in prompts]
    make_oracle(model, sequences)
    decoder = {"static": lambda: TreeDecoder(model, SMALL_TREE, topk=10),
               "chain": lambda: TreeDecoder(model, chain_choices(4), topk=1),
               "dynamic": lambda: TreeDecoder(model, None, dynamic_tree=DYNAMIC)}[kind]()
    results = decoder.generate_batch(prompts, DecodeConfig(max_new_tokens=n))
    for prompt, sequence, result in zip(prompts, sequences, results):
        assert result.tokens == sequence[len(prompt): len(prompt) + n]
        assert result.accepted_lengths == [depth + 1] * steps  # tau = depth + 1


def test_decoder_setting_dynamic_tree_is_checked_before_any_model_loads():
    from inference.registry import TreeSettings

    TreeSettings(dynamic_tree={"depth": 5, "topk": 8, "total": 48}).validate()
    with pytest.raises(ValueError, match=r"dynamic_tree.total=100 exceeds"):
        TreeSettings(dynamic_tree={"depth": 2, "topk": 3, "total": 100}).validate()
    with pytest.raises(ValueError, match=r"dynamic_tree must have the keys depth, topk and total"):
        TreeSettings(dynamic_tree={"depth": 2, "topk": 3}).validate()
