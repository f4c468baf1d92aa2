from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch

from medusa_train.tree import acceptance
from medusa_train.tree.acceptance import (
    chain_speculative_sample,
    greedy_accept,
    tree_speculative_sample,
    tree_speculative_sample_batch,
    typical_accept,
)
from medusa_train.tree.buffers import TreeBuffers, build_tree_buffers, chain_choices, gather_paths

# Nodes of HAND_TREE sorted by (depth, path): 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0].
# Paths (rows of retrieve_indices): 0: 0-1-3-6, 1: 0-1-4, 2: 0-2-5.
HAND_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
NODE_TOKENS = torch.tensor([7, 2, 3, 4, 5, 4, 6])  # token of each node
VOCAB = 8


def hand_tree() -> TreeBuffers:
    return build_tree_buffers(HAND_TREE, num_heads=3, topk=2)


def greedy_inputs(target_next: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates, path logits and valid mask for one row where node n's target argmax is target_next[n] (else 0).

    Padding positions of the candidates hold the token the target predicts there, so that an unmasked
    comparison would wrongly accept them.
    """
    tree = hand_tree()
    argmax = torch.tensor([target_next.get(n, 0) for n in range(tree.num_nodes)])
    node_logits = torch.nn.functional.one_hot(argmax, VOCAB).float() * 10.0  # [N, V]
    candidates = gather_paths(NODE_TOKENS.unsqueeze(0), tree)  # [1, P, D+1]
    logits = gather_paths(node_logits.unsqueeze(0), tree)  # [1, P, D+1, V]
    valid = tree.retrieve_valid
    shifted = torch.cat([candidates[..., :1], logits.argmax(-1)[..., :-1]], dim=-1)
    candidates = torch.where(valid, candidates, shifted)
    return candidates, logits, valid


GREEDY_CASES = {
    # name: (target argmax per node, (best_path, accept_length, next_token))
    "all_accepted_deepest": ({0: 2, 1: 4, 3: 6, 6: 1}, (0, 3, 1)),
    "none_accepted": ({0: 5}, (0, 0, 5)),
    "second_path_longer": ({0: 2, 1: 5, 4: 3}, (1, 2, 3)),
    "stops_at_depth_2": ({0: 2, 1: 4, 3: 1}, (0, 2, 1)),
    "other_branch_to_padding": ({0: 3, 2: 4, 5: 6}, (2, 2, 6)),
    "tie_goes_to_lowest_path": ({0: 2, 1: 0}, (0, 1, 0)),
}


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_accept_table(case: str) -> None:
    target_next, expected = GREEDY_CASES[case]
    candidates, logits, valid = greedy_inputs(target_next)
    best, length, next_token = greedy_accept(candidates, logits, valid)
    assert (best.tolist(), length.tolist(), next_token.tolist()) == ([expected[0]], [expected[1]], [expected[2]])


def test_greedy_accept_two_rows_with_different_lengths() -> None:
    rows = [greedy_inputs(GREEDY_CASES[name][0]) for name in ("all_accepted_deepest", "second_path_longer")]
    candidates = torch.cat([r[0] for r in rows])
    logits = torch.cat([r[1] for r in rows])
    best, length, next_token = greedy_accept(candidates, logits, rows[0][2])
    assert best.tolist() == [0, 1]
    assert length.tolist() == [3, 2]
    assert next_token.tolist() == [1, 3]


def test_greedy_accept_rejects_bad_shapes() -> None:
    candidates, logits, valid = greedy_inputs({})
    with pytest.raises(ValueError, match="target_logits_at_paths must be"):
        greedy_accept(candidates, logits[:, :2], valid)
    with pytest.raises(ValueError, match="valid must be bool"):
        greedy_accept(candidates, logits, valid.long())
    with pytest.raises(ValueError, match="candidates must be long"):
        greedy_accept(candidates[0], logits, valid)


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_typical_at_temperature_zero_is_greedy(case: str) -> None:
    candidates, logits, valid = greedy_inputs(GREEDY_CASES[case][0])
    greedy = greedy_accept(candidates, logits, valid)
    typical = typical_accept(candidates, logits, valid, 0.0, posterior_threshold=0.09, posterior_alpha=0.3)
    assert all(torch.equal(a, b) for a, b in zip(greedy, typical))


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_point_mass_sampling_with_one_hot_target_is_greedy(case: str) -> None:
    tree = hand_tree()
    target_next, (best, length, next_token) = GREEDY_CASES[case]
    argmax = torch.tensor([target_next.get(n, 0) for n in range(tree.num_nodes)])
    target = torch.nn.functional.one_hot(argmax, VOCAB).float()
    accepted, sampled_next = tree_speculative_sample(tree, NODE_TOKENS, target, None, torch.Generator().manual_seed(0))
    assert accepted.tolist() == tree.retrieve_indices[best, 1 : 1 + length].tolist()
    assert sampled_next == next_token


# p = [0.5, 0.25, 0.25] has entropy H = 1.5 ln 2, so exp(-H) = 2 ** -1.5 = 0.35355.
# At temperature 2, p' ∝ sqrt(p) = [0.41421, 0.29289, 0.29289], H' = 1.084391, exp(-H') = 0.338107.
TYPICAL_CASES = [
    # (temperature, epsilon, delta, drafted token, threshold computed by hand, accepted)
    (1.0, 0.09, 0.3, 1, 0.09, True),  # epsilon binds: min(0.09, 0.10607)
    (1.0, 0.3, 1.0, 1, 0.3, False),  # epsilon binds, 0.25 < 0.3
    (1.0, 0.3, 1.0, 0, 0.3, True),  # 0.5 > 0.3
    (1.0, 0.5, 0.6, 1, 0.6 * 2**-1.5, True),  # delta binds: 0.21213 < 0.25
    (1.0, 0.5, 0.8, 1, 0.8 * 2**-1.5, False),  # delta binds: 0.28284 > 0.25
    (2.0, 1.0, 0.8, 1, 0.8 * 0.338107, True),  # temperature flattens p: 0.29289 > 0.27049
]


@pytest.mark.parametrize(("temperature", "eps", "delta", "token", "threshold", "accepted"), TYPICAL_CASES)
def test_typical_threshold_by_hand(
    temperature: float, eps: float, delta: float, token: int, threshold: float, accepted: bool
) -> None:
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    scaled = p ** (1 / temperature) / (p ** (1 / temperature)).sum()
    entropy = -(scaled * scaled.log()).sum().item()
    assert min(eps, delta * math.exp(-entropy)) == pytest.approx(threshold, abs=1e-5)
    assert (scaled[token].item() > threshold) is accepted

    # one path, one drafted token; the position after it predicts token 2 with certainty
    candidates = torch.tensor([[[0, token]]])
    logits = torch.stack([p.log().float(), torch.tensor([-30.0, -30.0, 30.0])]).view(1, 1, 2, 3)
    valid = torch.ones(1, 2, dtype=torch.bool)
    best, length, next_token = typical_accept(
        candidates, logits, valid, temperature, posterior_threshold=eps, posterior_alpha=delta,
        generator=torch.Generator().manual_seed(0),
    )
    assert best.tolist() == [0]
    assert length.tolist() == [int(accepted)]
    if accepted:
        assert next_token.tolist() == [2]


def test_typical_tie_between_paths_goes_to_likelier_tokens() -> None:
    tree = build_tree_buffers([[0], [1]], num_heads=1, topk=2)
    node_tokens = torch.tensor([[0, 1, 2]])  # path 0 drafts token 1 (p=0.3), path 1 token 2 (p=0.6)
    # root: p = [0.1, 0.3, 0.6], both drafts clear the threshold (<= 0.09); after token 2 the target is sure of 2
    node_logits = torch.tensor([[[0.1, 0.3, 0.6], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]).clamp_min(1e-12).log()
    best, length, next_token = typical_accept(
        gather_paths(node_tokens, tree), gather_paths(node_logits, tree), tree.retrieve_valid, 1.0,
        posterior_threshold=0.09, posterior_alpha=0.3, generator=torch.Generator().manual_seed(0),
    )
    assert (best.tolist(), length.tolist(), next_token.tolist()) == ([1], [1], [2])


def test_typical_next_token_follows_target_at_last_accepted_position() -> None:
    # chain of 2 drafts: the first is accepted, the second rejected, so the next token is sampled from the
    # distribution at position 1 (q1), not at position 0 or 2.
    rows = 4000
    p0 = torch.tensor([0.05, 0.9, 0.05])  # drafted token 1: accepted
    q1 = torch.tensor([0.6, 0.05, 0.35])  # drafted token 1: rejected; next ~ q1
    p2 = torch.tensor([0.0, 0.0, 1.0])
    logits = torch.stack([p0, q1, p2]).log().view(1, 1, 3, 3).expand(rows, 1, 3, 3)
    candidates = torch.tensor([[[0, 1, 1]]]).expand(rows, 1, 3)
    best, length, next_token = typical_accept(
        candidates, logits, torch.ones(1, 3, dtype=torch.bool), 1.0, posterior_threshold=0.09,
        posterior_alpha=0.3, generator=torch.Generator().manual_seed(3),
    )
    assert length.unique().tolist() == [1]
    frequencies = torch.bincount(next_token, minlength=3).float() / rows
    assert torch.allclose(frequencies, q1, atol=0.03)


def test_typical_padding_is_never_accepted() -> None:
    candidates, logits, valid = greedy_inputs(GREEDY_CASES["other_branch_to_padding"][0])
    _, length, _ = typical_accept(candidates, logits, valid, 1.0, posterior_threshold=0.09, posterior_alpha=0.3)
    assert length.tolist() == [2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"posterior_threshold": 0.0}, r"posterior_threshold must be \(0, 1\]"),
        ({"posterior_threshold": 1.5}, r"posterior_threshold must be \(0, 1\]"),
        ({"posterior_threshold": float("nan")}, r"posterior_threshold must be \(0, 1\]"),
        ({"posterior_alpha": 0.0}, "posterior_alpha must be > 0 and finite"),
        ({"posterior_alpha": -0.3}, "posterior_alpha must be > 0 and finite"),
        ({"posterior_alpha": math.inf}, "posterior_alpha must be > 0 and finite"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_typical_validates_arguments(kwargs: dict, message: str) -> None:
    candidates, logits, valid = greedy_inputs({})
    arguments = {"temperature": 1.0, "posterior_threshold": 0.09, "posterior_alpha": 0.3} | kwargs
    with pytest.raises(ValueError, match=message):
        typical_accept(candidates, logits, valid, **arguments)


# ---------------------------------------------------------------------------------------------------------
# Speculative sampling: deterministic checks


def test_chain_accepts_everything_when_draft_equals_target() -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(4, 6, generator=gen), dim=-1)
    for _ in range(50):
        tokens = torch.multinomial(target[:3], 1, generator=gen).squeeze(-1)
        length, next_token = chain_speculative_sample(tokens, target[:3], target, gen)
        assert length == 3
        assert 0 <= next_token < 6


def test_chain_rejects_impossible_token_and_recovers_from_residual() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # residual max(0, p - q) = [0, 0, 0.5, 0] -> token 2
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert chain_speculative_sample(torch.tensor([0]), draft, target, gen) == (0, 2)
    # a point-mass draft of token 1: accepted with p(1) = 0.5, else the residual zeroes token 1 -> token 2
    outcomes = {chain_speculative_sample(torch.tensor([1]), None, target, gen) for _ in range(40)}
    assert {o for o in outcomes if o[0] == 0} == {(0, 2)}
    assert any(o[0] == 1 for o in outcomes)


def test_chain_without_drafts_samples_target() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0]])
    assert chain_speculative_sample(torch.tensor([], dtype=torch.long), None, target) == (0, 2)


def test_chain_matches_tree_sampler_on_chain_tree() -> None:
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(4, 5, generator=gen), dim=-1)
    draft = torch.softmax(torch.randn(3, 5, generator=gen), dim=-1)
    tokens = torch.tensor([1, 4, 0])
    tree = build_tree_buffers(chain_choices(3), num_heads=3, topk=1)
    node_draft = torch.cat([torch.zeros(1, 5), draft])
    for seed in range(30):
        accepted, tree_next = tree_speculative_sample(
            tree, torch.cat([torch.tensor([0]), tokens]), target, node_draft, torch.Generator().manual_seed(seed)
        )
        length, chain_next = chain_speculative_sample(tokens, draft, target, torch.Generator().manual_seed(seed))
        assert accepted.tolist() == list(range(1, length + 1))
        assert chain_next == tree_next


def test_chain_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"target_probs \[K\+1, V\]"):
        chain_speculative_sample(torch.tensor([1, 2]), None, torch.ones(2, 4) / 4)
    with pytest.raises(ValueError, match="draft_probs must be None or"):
        chain_speculative_sample(torch.tensor([1]), torch.ones(1, 3) / 3, torch.ones(2, 4) / 4)


def test_tree_sampler_rejects_bad_inputs() -> None:
    tree = hand_tree()
    target = torch.full((1, 7, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match=r"node_tokens must be long \[B, N=7\]"):
        tree_speculative_sample_batch(tree, NODE_TOKENS[None, :6], target, None)
    with pytest.raises(ValueError, match="target_probs must be float"):
        tree_speculative_sample_batch(tree, NODE_TOKENS[None], target[:, :6], None)
    with pytest.raises(ValueError, match="draft_probs must be None or"):
        tree_speculative_sample_batch(tree, NODE_TOKENS[None], target, target[..., :4])
    with pytest.raises(ValueError, match=r"node_tokens must lie in \[0, V=8\)"):
        tree_speculative_sample_batch(tree, NODE_TOKENS[None] + 2, target, None)


# ---------------------------------------------------------------------------------------------------------
# Speculative sampling: the output distribution equals the target's (chi-square at alpha = 0.001)

V = 5
SAMPLES = 20_000
ALPHA = 1e-3
SIBLING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]  # node 3 ([2]) is a depth-1 leaf: a bonus at depth 1


@lru_cache(maxsize=1)
def _tables() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Target conditionals by prefix length k (tables[k] is [V**k, V]) and the draft distributions.

    q1 [V] drafts depth-1 nodes (shared by siblings, like one Medusa head); q2 [V, V] drafts depth-2 nodes given
    the parent's token. Drafts are deliberately unlike the targets, so rejections are frequent.
    """
    gen = torch.Generator().manual_seed(1234)
    tables = [torch.softmax(torch.randn(V**k, V, generator=gen, dtype=torch.float64) * 0.8, -1) for k in range(4)]
    q1 = torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=gen, dtype=torch.float64) * 1.5, -1)
    return tables, q1, q2


def _prefix_index(tokens: torch.Tensor) -> torch.Tensor:
    """long [B, k] -> long [B], the row of tables[k] for that prefix."""
    weights = V ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens * weights).sum(-1)


def _speculative_step(
    tree: TreeBuffers, context: torch.Tensor, drafts: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step for B rows after ``context`` [B, c]: draft the tree, sample, return the emitted
    tokens [B, D+1] (padded with -1) and how many were emitted [B].

    drafts: "sampled" (each node's token drawn from its draft, siblings independently, draft_probs passed),
    "top_k" (the node of rank r takes the draft's r-th most likely token, draft_probs None) or "top_k_with_q"
    (top-k tokens but the draft distribution passed as if they had been sampled: a misuse, not lossless).
    """
    tables, q1, q2 = _tables()
    batch, c = context.shape
    parents = tree.parents.tolist()
    depths = tree.position_ids.tolist()
    children = tree.children.tolist()
    order1 = torch.argsort(q1, descending=True, stable=True)  # [V]
    order2 = torch.argsort(q2, dim=-1, descending=True, stable=True)  # [V, V]
    tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.long)
    target = torch.zeros(batch, tree.num_nodes, V, dtype=torch.float64)
    draft = torch.zeros(batch, tree.num_nodes, V, dtype=torch.float64)
    prefixes = {0: context}
    target[:, 0] = tables[c][_prefix_index(context)]
    for node in range(1, tree.num_nodes):
        parent = parents[node]
        depth_one = depths[node] == 1
        q = q1.expand(batch, V) if depth_one else q2[tokens[:, parent]]
        if drafts == "sampled":
            tokens[:, node] = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        else:
            rank = children[parent].index(node)
            tokens[:, node] = order1[rank] if depth_one else order2[tokens[:, parent], rank]
        draft[:, node] = q
        prefixes[node] = torch.cat([prefixes[parent], tokens[:, node : node + 1]], dim=1)
        target[:, node] = tables[c + depths[node]][_prefix_index(prefixes[node])]

    accepted, length, next_token = tree_speculative_sample_batch(
        tree, tokens, target, None if drafts == "top_k" else draft, gen
    )
    # the accepted nodes form a root path
    for d in range(1, tree.max_depth):
        deeper = accepted[:, d] >= 0
        assert torch.equal(tree.parents[accepted[deeper, d]], accepted[deeper, d - 1])
    emitted = torch.where(accepted >= 0, tokens.gather(1, accepted.clamp(min=0)), -1)
    emitted = torch.cat([emitted, torch.full((batch, 1), -1)], dim=1)
    emitted[torch.arange(batch), length] = next_token
    return emitted, length + 1


def _p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.flatten() * observed.sum()
    assert expected.min() >= 5, "chi-square needs expected counts >= 5: change the seed or V"
    statistic = ((observed.flatten() - expected) ** 2 / expected).sum()
    df = torch.tensor(float(expected.numel() - 1), dtype=torch.float64)
    return 1.0 - torch.distributions.Chi2(df).cdf(statistic).item()


def _first_two_tokens_p_values(tree: TreeBuffers, drafts: str, seed: int = 0) -> tuple[float, float]:
    """p-values of chi-square tests of (first token) and (first two tokens) against the target."""
    tables, _, _ = _tables()
    gen = torch.Generator().manual_seed(seed)
    emitted, count = _speculative_step(tree, torch.zeros(SAMPLES, 0, dtype=torch.long), drafts, gen)
    first = emitted[:, 0]
    # rows that emitted one token take their second from a second step after it
    following, _ = _speculative_step(tree, first.unsqueeze(1), drafts, gen)
    second = torch.where(count >= 2, emitted[:, 1], following[:, 0])

    p_first = tables[0][0]
    p_pair = p_first.unsqueeze(1) * tables[1]  # [V, V]: p(x1) p(x2 | x1)
    observed_first = torch.bincount(first, minlength=V).double()
    observed_pair = torch.bincount(first * V + second, minlength=V * V).double()
    return _p_value(observed_first, p_first), _p_value(observed_pair, p_pair)


TREES = {
    "siblings": lambda: build_tree_buffers(SIBLING_TREE, num_heads=2, topk=3),
    "chain": lambda: build_tree_buffers(chain_choices(2), num_heads=2, topk=1),
}


@pytest.mark.parametrize("drafts", ["sampled", "top_k"])
@pytest.mark.parametrize("tree_name", TREES)
def test_speculative_sampling_keeps_target_distribution(tree_name: str, drafts: str) -> None:
    p_first, p_pair = _first_two_tokens_p_values(TREES[tree_name](), drafts)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)


def _accept_always(p_x: torch.Tensor, q_x: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(p_x)


def _resample_from_target(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return p


@pytest.mark.parametrize("drafts", ["sampled", "top_k"])
@pytest.mark.parametrize(
    ("name", "replacement"),
    [("_acceptance_probability", _accept_always), ("_residual", _resample_from_target)],
    ids=["accept_always", "resample_from_target"],
)
def test_broken_rules_fail_the_same_check(
    monkeypatch: pytest.MonkeyPatch, name: str, replacement: object, drafts: str
) -> None:
    monkeypatch.setattr(acceptance, name, replacement)
    p_first, p_pair = _first_two_tokens_p_values(TREES["siblings"](), drafts)
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)


def test_top_k_drafts_with_draft_probs_are_not_lossless() -> None:
    # Deterministic top-k candidates must be passed with draft_probs=None; passing the head distribution as if
    # the candidates had been sampled from it biases the output, and the same check catches it.
    p_first, p_pair = _first_two_tokens_p_values(TREES["siblings"](), "top_k_with_q")
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)
