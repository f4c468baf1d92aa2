"""Hydra heads in the tree decoder: the level-by-level drafter fills the nodes with the right paths, greedy output
equals plain greedy decoding, perfect heads accept the whole depth, typical and speculative acceptance work, and
drafting and verification time are reported."""

from __future__ import annotations

import pytest
import torch

from inference.decoders import DecodeConfig, TreeDecoder
from medusa_train.models.catalog import tree_drafter
from medusa_train.drafters.hydra.proposer import HydraTreeDrafter
from medusa_train.drafters.medusa.proposer import MedusaTreeDrafter
from medusa_train.models.features import FINAL
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from medusa_train.tree.buffers import MC_SIM_7B_63, SMALL_TREE_15, build_tree_buffers, chain_choices
from medusa_train.models.tree_drafter import tree_levels
from tests.conftest import VOCAB, chi_square, make_tiny_model
from tests.inference.test_decoders import PROMPTS, check_counts, greedy, random_heads

SMALL_TREE = [list(p) for p in SMALL_TREE_15]  # depth 3, 16 nodes, ranks < 6

pytestmark = pytest.mark.usefixtures("one_thread")


def random_hydra(base: torch.nn.Module, num_heads: int = 3, seed: int = 0, combine: str = "concat") -> SpeculativeModel:
    """Hydra heads with random blocks: they disagree with the base often, so many drafts are rejected."""
    return random_heads("hydra", base, num_heads, seed, combine=combine)


class PathLookupHydra(SpeculativeModel):
    """Test-only Hydra model whose heads are perfect on the true path and wrong off it: head k at position t
    predicts ``sequence[t + k + 2]`` when the path it is given is ``sequence[t + 1 .. t + k + 1]``, else a token that
    is certainly wrong. The position is recovered from the hidden state (nearest of the base's hidden states over
    ``sequence``), as in ``test_decoders.LookupHeadsMedusa``. Every call's paths are recorded."""

    def __init__(self, base: torch.nn.Module, num_heads: int, sequence: list[int]) -> None:
        super().__init__(base, new_heads_for(base, num_heads, head_type="hydra"))
        with torch.no_grad():
            self.table = base.base_model(torch.tensor([sequence])).last_hidden_state[0]  # [S, H]
        self.sequence = sequence
        self.calls: list[tuple[int, list[list[int]]]] = []

    def head_logits_at(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        paths = path_tokens.reshape(-1, k + 1).tolist()
        self.calls.append((k, paths))
        position = torch.cdist(flat.float(), self.table.float()).argmin(dim=-1).tolist()
        logits = torch.zeros(flat.shape[0], VOCAB)
        for m, (t, path) in enumerate(zip(position, paths)):
            right = self.sequence[t + k + 2]
            on_path = path == self.sequence[t + 1 : t + k + 2]
            logits[m, right if on_path else (right + 1) % VOCAB] = 1.0
        return logits.reshape(*hidden.shape[:-1], VOCAB)


# --- the drafter -----------------------------------------------------------------------------------------------------

def test_levels_of_a_hand_drawn_tree():
    #           root(0)
    #     [0](1)      [1](2)
    #  [0,0](3) [0,1](4)  [1,0](5)
    #  [0,0,0](6)
    tree = build_tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3, topk=2)
    levels = tree_levels(tree)
    assert [lv.depth for lv in levels] == [0, 1, 2]
    assert levels[0].paths.tolist() == [[0]] and levels[0].children.tolist() == [1, 2]
    assert levels[0].rank.tolist() == [0, 1] and levels[0].width == 2
    assert levels[1].paths.tolist() == [[0, 1], [0, 2]] and levels[1].children.tolist() == [3, 4, 5]
    assert levels[1].parent.tolist() == [0, 0, 1] and levels[1].rank.tolist() == [0, 1, 0]
    assert levels[2].paths.tolist() == [[0, 1, 3]] and levels[2].children.tolist() == [6] and levels[2].width == 1


def test_each_level_reads_the_path_of_the_node_it_expands():
    base = make_tiny_model("llama")
    prompt = PROMPTS[0]
    sequence = prompt + greedy(base, prompt, 20)
    model = PathLookupHydra(base, 3, sequence)
    tree = build_tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3, topk=2)
    t = len(prompt) - 1
    ids = torch.tensor([sequence[: t + 1]])
    hidden = base.base_model(torch.tensor([sequence])).last_hidden_state[:, : t + 1]  # [1, t + 1, H]
    root = torch.tensor([sequence[t + 1]])
    drafter = HydraTreeDrafter(model)
    drafter.start({FINAL: hidden}, ids, torch.ones_like(ids, dtype=torch.bool))
    tokens = drafter.draft(root, tree)[0].tolist()
    right = sequence[t + 1 : t + 5]
    # rank 0 of each head on the true path is the true token; rank 1 is the (wrong) lookup's second choice
    assert tokens[0] == right[0] and tokens[1] == right[1] and tokens[3] == right[2] and tokens[6] == right[3]
    assert [k for k, _ in model.calls] == [0, 1, 2]  # one call per depth, over that depth's expanded nodes
    assert model.calls[1][1] == [[tokens[0], tokens[1]], [tokens[0], tokens[2]]]
    assert model.calls[2][1] == [[tokens[0], tokens[1], tokens[3]]]
    # node [1, 0] continues head 0's rank-1 token: off the true path, so its head-1 token is not the true one
    assert tokens[5] != right[2]


def test_tree_drafter_follows_the_head_type():
    base = make_tiny_model("llama")
    assert isinstance(tree_drafter(SpeculativeModel(base, new_heads_for(base, 2))), MedusaTreeDrafter)
    assert isinstance(tree_drafter(SpeculativeModel(base, new_heads_for(base, 2, head_type="hydra"))), HydraTreeDrafter)


# --- greedy = plain greedy --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combine", ["concat", "sum"])
def test_hydra_batched_greedy_equals_each_prompt_alone(combine):
    base = make_tiny_model("llama")
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    expected = [greedy(base, p, 30) for p in prompts]
    results = TreeDecoder(random_hydra(base, combine=combine), SMALL_TREE, topk=10).generate_batch(
        prompts, DecodeConfig(max_new_tokens=30))
    assert [r.tokens for r in results] == expected
    for r in results:
        check_counts(r)


@pytest.mark.parametrize("choices,num_heads", [(SMALL_TREE, 3), ([list(p) for p in MC_SIM_7B_63], 4),
                                               (chain_choices(2), 2)])
def test_perfect_path_heads_accept_the_whole_depth_every_step(choices, num_heads):
    """With heads right only when given the true path, every step accepting the whole depth shows that each level
    was drafted from its node's own path (Medusa heads, blind to the path, could not be made to do this)."""
    base = make_tiny_model("llama")
    depth = max(len(p) for p in choices)
    steps = 6
    n = 1 + (depth + 1) * steps
    prompt = PROMPTS[0]
    continuation = greedy(base, prompt, n + num_heads + 2)
    model = PathLookupHydra(base, num_heads, prompt + continuation)
    result = TreeDecoder(model, choices, topk=10).generate(prompt, DecodeConfig(max_new_tokens=n))
    assert result.tokens == continuation[:n]
    assert result.accepted_lengths == [depth + 1] * steps
    assert [k for k, _ in model.calls] == list(range(depth)) * steps  # one head call per level and step


def test_draft_and_verification_time_are_reported_for_tree_decoding():
    base = make_tiny_model("llama")
    for model in (random_hydra(base), SpeculativeModel(base, new_heads_for(base, 3))):
        result = TreeDecoder(model, SMALL_TREE, topk=10).generate(PROMPTS[0], DecodeConfig(max_new_tokens=20))
        assert result.draft_time_s > 0 and result.verify_time_s > 0
        assert result.prefill_time_s + result.draft_time_s + result.verify_time_s <= result.wall_time_s


# --- other acceptance rules -------------------------------------------------------------------------------------------

def test_perfect_path_heads_typical_acceptance_at_low_temperature_accepts_everything():
    base = make_tiny_model("llama")
    prompt = PROMPTS[0]
    continuation = greedy(base, prompt, 20)
    model = PathLookupHydra(base, 3, prompt + continuation)
    result = TreeDecoder(model, SMALL_TREE, topk=10, acceptance="typical").generate(
        prompt, DecodeConfig(max_new_tokens=13, temperature=1e-4, seed=0))
    assert result.accepted_lengths == [4, 4, 4]


@pytest.mark.slow
def test_hydra_speculative_sampling_keeps_the_target_distribution_of_the_first_two_tokens():
    """Chi-square of the first two sampled tokens against the model's exact joint distribution (V = 8), as the
    Medusa test does; here head 1's candidates depend on the token head 0 drafted below them."""
    base = make_tiny_model("llama", vocab_size=8, initializer_range=0.3, num_hidden_layers=1)
    model = random_hydra(base, num_heads=2)
    prompt = [1, 5, 3]
    choices = [[0], [1], [2], [0, 0], [1, 0]]
    with torch.no_grad():
        p1 = torch.softmax(base(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(base(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
                          for a in range(8)])
    joint = p1[:, None] * p2
    decoder = TreeDecoder(model, choices, topk=3, acceptance="speculative")
    samples = 1000
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for seed in range(samples):
        tokens = decoder.generate(prompt, DecodeConfig(max_new_tokens=2, temperature=1.0, seed=seed)).tokens
        counts[tokens[0], tokens[1]] += 1
    p_value, chi2, dof = chi_square(counts, joint * samples)
    assert p_value > 1e-3, (chi2, dof)
