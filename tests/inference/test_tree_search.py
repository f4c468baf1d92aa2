from __future__ import annotations

import itertools

import pytest

from inference.tuning.search import (
    best_tree_for_latency,
    monotone_envelope,
    check_accuracy_table,
    expected_accept_length,
    greedy_tree,
    interpolate,
)


def all_prefix_closed_trees(num_heads, ranks, size):
    """Every prefix-closed set of ``size`` paths over ``num_heads`` heads and ``ranks`` ranks (brute force)."""
    paths = [p for d in range(1, num_heads + 1) for p in itertools.product(range(ranks), repeat=d)]
    for subset in itertools.combinations(paths, size):
        chosen = set(subset)
        if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
            yield [list(p) for p in subset]


def brute_force_expectation(acc, tree):
    """E[accepted tokens] by enumerating every outcome: head k's correct rank (or none) independently per head."""
    total = 0.0
    outcomes = [list(range(len(row))) + [None] for row in acc]
    for outcome in itertools.product(*outcomes):
        prob = 1.0
        for k, r in enumerate(outcome):
            prob *= acc[k][r] if r is not None else 1.0 - sum(acc[k])
        # accepted length = longest tree path all of whose ranks match the outcome
        best = 0
        for path in tree:
            if all(outcome[j] == path[j] for j in range(len(path))):
                best = max(best, len(path))
        total += prob * (1 + best)
    return total


TABLE = [[0.5, 0.2, 0.1], [0.3, 0.15, 0.05]]


def test_greedy_on_hand_made_table_returns_known_best_tree():
    # node values: (0)=.5 (1)=.2 (0,0)=.15 (2)=.1 (0,1)=.075 (1,0)=.06 ...
    assert greedy_tree(TABLE, 4) == [[0], [1], [0, 0], [2]]
    assert expected_accept_length(TABLE, [[0], [1], [0, 0], [2]]) == pytest.approx(1.95)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_expected_length_formula_matches_brute_force_and_greedy_is_optimal(size):
    trees = list(all_prefix_closed_trees(2, 3, size))
    best = max(brute_force_expectation(TABLE, t) for t in trees)
    for t in trees[:50]:
        assert expected_accept_length(TABLE, t) == pytest.approx(brute_force_expectation(TABLE, t))
    assert expected_accept_length(TABLE, greedy_tree(TABLE, size)) == pytest.approx(best)


def test_greedy_tree_is_prefix_closed_and_parents_first():
    table = [[0.6, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.1, 0.05, 0.01]]
    tree = greedy_tree(table, 30)
    seen = set()
    for path in tree:
        assert len(path) == 1 or tuple(path[:-1]) in seen
        seen.add(tuple(path))
    assert len(seen) == 30


def test_latency_aware_size_stops_where_rate_peaks():
    table = [[0.6, 0.2], [0.4, 0.1]]
    # flat latency up to 4 tokens then steep: the best size is where expected/latency peaks
    latency = {1: 10.0, 4: 10.0, 8: 40.0}
    tree, rates = best_tree_for_latency(table, latency)
    assert len(tree) == 3  # 4 tokens incl. root: every larger tree costs far more than it brings
    assert rates[4]["tokens_per_s"] == max(r["tokens_per_s"] for r in rates.values())
    assert interpolate({"1": 1.0, "3": 3.0}, 2) == 2.0


def test_a_noisy_latency_bump_does_not_pick_a_larger_tree():
    # Measured: 2 tokens slower than 4 (noise). The envelope caps size 2 at 4's 12 ms, so 2 nodes win on their merit.
    assert monotone_envelope({"1": 10.0, "2": 15.0, "4": 12.0, "8": 30.0}) == {1: 10.0, 2: 12.0, 4: 12.0, 8: 30.0}
    table = [[0.6, 0.2], [0.4, 0.1]]
    noisy, _ = best_tree_for_latency(table, {1: 10.0, 2: 15.0, 4: 12.0, 8: 30.0})
    clean, _ = best_tree_for_latency(table, {1: 10.0, 2: 12.0, 4: 12.0, 8: 30.0})
    assert noisy == clean == [[0], [0, 0], [1]]


@pytest.mark.parametrize("table,match", [
    ([], "empty"),
    ([[0.5, 1.2]], "not a probability"),
    ([[0.5, 0.1], [0.2]], "row 1"),
])
def test_bad_tables(table, match):
    with pytest.raises(ValueError, match=match):
        check_accuracy_table(table)


def test_table_for_other_heads_and_bad_budget():
    with pytest.raises(ValueError, match="the export has 3 heads"):
        check_accuracy_table(TABLE, num_heads=3)
    with pytest.raises(ValueError, match="budget"):
        greedy_tree(TABLE, 0)


def test_rank_hits_counts_by_hand():
    import torch

    from inference.tuning.accuracy import count_rank_hits, target_ranks

    def rank_hits(logits, tokens, valid, topk):
        return count_rank_hits(target_ranks(logits, tokens, topk), valid, topk)

    # K=2 heads, B=1, T=5, V=4. tokens: 0 1 2 3 0
    tokens = torch.tensor([[0, 1, 2, 3, 0]])
    logits = torch.zeros(2, 1, 5, 4)
    # head 0 at t predicts t+2: targets 2,3,0 at t=0,1,2. rank-0 right at t=0, rank-1 right at t=1, wrong at t=2
    logits[0, 0, 0, 2] = 5
    logits[0, 0, 1, 0] = 5
    logits[0, 0, 1, 3] = 4
    logits[0, 0, 2, 1] = 5
    logits[0, 0, 2, 2] = 4
    # head 1 at t predicts t+3: targets 3, 0 at t=0,1; rank 0 right at t=1 only
    logits[1, 0, 1, 0] = 5
    logits[1, 0, 1, 1] = 4
    logits[1, 0, 0] = torch.tensor([3.0, 2.0, 1.0, 0.0])  # target 3 is last: no hit
    logits[0, 0, 0, 1] = 4  # distinct rank 1 everywhere, no ties
    valid = torch.ones(1, 5, dtype=torch.bool)
    hits, totals = rank_hits(logits, tokens, valid, topk=2)
    assert totals.tolist() == [3, 2]
    assert hits.tolist() == [[1, 1], [1, 0]]
    valid[0, 0] = False  # t=0 no longer counts
    hits, totals = rank_hits(logits, tokens, valid, topk=2)
    assert totals.tolist() == [2, 1] and hits.tolist() == [[0, 1], [1, 0]]


def test_replay_follows_greedy_verification_by_hand():
    from inference.tuning.replay import accepted_depth, replay_counts, replayed_accept_length

    tree = {(0,), (1,), (0, 0)}
    assert accepted_depth([0, 0, 3], tree) == 2
    assert accepted_depth([1, 0], tree) == 1  # (1, 0) is not in the tree
    assert accepted_depth([-1, 0], tree) == 0
    # one prompt, 6 states (a 7-token continuation). s=0 accepts 2 -> s=3 accepts 0 -> s=4 accepts 1 -> s=6: done
    states = [[0, 0], [5, 5], [5, 5], [2, 0], [1, -1], [0, 0]]
    assert replay_counts([states], [[0], [1], [0, 0]]) == (6, 3)
    # a chain of depth 1 on the same states: s=0 +2, s=2 +1, s=3 +1, s=4 +1, s=5 +2 -> 5 passes
    assert replay_counts([states], [[0]]) == (6, 5)
    assert replayed_accept_length([states, [[0, 0]]], [[0]]) == pytest.approx(7 / 6)
    with pytest.raises(ValueError, match="shorter than two tokens"):
        replayed_accept_length([[]], [[0]])


def test_replay_is_below_the_formula_when_hits_come_in_runs():
    # head 0 is right on the first half of the positions and wrong on the second: per-position accuracy 0.5, so the
    # formula predicts 1.5, but decoding skips half of the easy positions: 10 passes over the easy 20 (2 tokens
    # each), 20 over the hard 20 -> 40 tokens / 30 passes
    from inference.tuning.replay import replayed_accept_length

    states = [[0]] * 20 + [[-1]] * 20
    assert expected_accept_length([[0.5]], [[0]]) == pytest.approx(1.5)
    assert replayed_accept_length([states], [[0]]) == pytest.approx(40 / 30)


def test_target_ranks_and_hits_count_a_target_outside_the_head_vocab_as_a_miss():
    import torch

    from inference.tuning.accuracy import count_rank_hits, target_ranks

    tokens = torch.tensor([[0, 1, 2, -1]])  # the last token is outside a reduced head vocabulary
    logits = torch.zeros(1, 1, 4, 3)
    logits[0, 0, 0, 2] = 5  # t=0 predicts token 2 at t=2: right
    logits[0, 0, 1, 0] = 5  # t=1 predicts token 0 at t=3, whose target is out of the vocabulary
    ranks = target_ranks(logits, tokens, topk=2)
    assert ranks[0, 0].tolist() == [0, -1, -1, -1]
    hits, totals = count_rank_hits(ranks, torch.ones(1, 4, dtype=torch.bool), topk=2)
    assert totals.tolist() == [2] and hits.tolist() == [[1, 0]]


def test_tree_size_is_chosen_by_replayed_tokens_when_ranks_are_recorded():
    # one head: rank 0 right on the first 10 states, never on the last 10; rank 1 never right in the recording
    table = [[0.5, 0.3]]
    states = [[0]] * 10 + [[-1]] * 10
    latency = {1: 10.0, 2: 10.0, 3: 11.0}
    by_formula, _ = best_tree_for_latency(table, latency)
    assert by_formula == [[0], [1]]  # 1.8 tokens / 11 ms beats 1.5 / 10
    by_replay, rates = best_tree_for_latency(table, latency, target_ranks=[states])
    assert by_replay == [[0]]  # the second node adds nothing on the recording: 20 tokens / 15 passes either way
    assert rates[2]["replayed_tokens"] == rates[3]["replayed_tokens"] == pytest.approx(20 / 15)
    assert rates[2]["tokens_per_s"] == pytest.approx(20 / 15 / 10.0 * 1000.0)


def test_the_shortlist_times_the_predicted_best_and_the_measured_sizes_near_it():
    from inference.tuning.timed import shortlist

    rates = {n: {"tokens_per_s": r} for n, r in {2: 10.0, 3: 12.0, 4: 11.0, 8: 8.5, 16: 6.0}.items()}
    assert shortlist(rates, [1, 2, 4, 8, 16]) == [2, 3, 4, 8]  # 3 is the best; 16 (0.5 of it) is left out
    assert shortlist(rates, [1, 2, 4, 8, 16], ratio=1.0) == [3]
    with pytest.raises(ValueError, match=r"shortlist ratio must be in \(0, 1\], got 0"):
        shortlist(rates, [2], ratio=0)
    with pytest.raises(ValueError, match="no candidate tree sizes"):
        shortlist({}, [2])


def test_timed_trees_count_what_the_decoder_decodes():
    from inference.decoders.base import DecodeConfig
    from inference.decoders.tree import TreeDecoder
    from medusa_train.models.speculative import SpeculativeModel, new_heads_for
    from inference.tuning.timed import fastest, time_trees
    from tests.conftest import make_tiny_model

    base = make_tiny_model("llama")
    model = SpeculativeModel(base, new_heads_for(base, num_heads=2)).eval()
    prompts = [[1, 5, 9, 3], [7, 7, 2]]
    trees = {2: [[0]], 4: [[0], [1], [0, 0]]}
    timed = time_trees(model, prompts, trees, max_new_tokens=12)
    assert set(timed) == {2, 4} and timed[fastest(timed)]["tokens_per_s"] == max(r["tokens_per_s"]
                                                                                  for r in timed.values())
    for n, row in timed.items():
        direct = [TreeDecoder(model, trees[n]).generate(p, DecodeConfig(max_new_tokens=12)) for p in prompts]
        passes = sum(r.forward_passes for r in direct)
        assert row["tokens"] == 2 * 11 == sum(r.new_tokens - 1 for r in direct)  # no EOS: every reply is 12
        assert row["mean_accepted_tokens"] == pytest.approx(row["tokens"] / passes)
        assert row["step_ms"] == pytest.approx(1000 * row["seconds"] / passes)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    with pytest.raises(ValueError, match="at least one prompt and one tree"):
        time_trees(model, [], trees)
