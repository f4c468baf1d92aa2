from __future__ import annotations

from collections import Counter

import pytest
import torch

from medusa_train.tree.buffers import (
    MC_SIM_7B_63,
    SMALL_TREE_15,
    build_tree_buffers,
    chain_choices,
    gather_node_tokens,
    gather_paths,
    validate_medusa_choices,
)

# Hand-drawn tree, given out of order on purpose. Sorted by (depth, path) its nodes are
#   0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
#   root -+- 1 -+- 3 --- 6
#         |     +- 4
#         +- 2 --- 5
HAND_TREE = [[0, 0], [1], [0, 0, 0], [0], [1, 0], [0, 1]]


def test_hand_tree_buffers() -> None:
    tree = build_tree_buffers(HAND_TREE, num_heads=3, topk=2)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (tree.num_nodes, tree.max_depth, tree.num_paths, tree.max_children) == (7, 3, 3, 2)
    assert (tree.num_heads, tree.topk) == (3, 2)
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert tree.attn_mask.dtype == torch.bool
    assert torch.equal(tree.attn_mask, expected_mask)
    # flat candidates: [root, head0 rank0, head0 rank1, head1 rank0, head1 rank1, head2 rank0, head2 rank1]
    assert torch.equal(tree.tree_indices, torch.tensor([0, 1, 2, 3, 4, 3, 5]))
    assert torch.equal(tree.position_ids, torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    assert tree.depths is tree.position_ids
    assert torch.equal(tree.parents, torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
    assert torch.equal(
        tree.children, torch.tensor([[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]])
    )
    assert torch.equal(tree.retrieve_indices, torch.tensor([[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1]]))
    assert torch.equal(
        tree.retrieve_valid,
        torch.tensor([[True, True, True, True], [True, True, True, False], [True, True, True, False]]),
    )
    for name in ("tree_indices", "position_ids", "parents", "children", "retrieve_indices"):
        assert getattr(tree, name).dtype == torch.long, name


def test_gather_helpers_on_hand_tree() -> None:
    tree = build_tree_buffers(HAND_TREE, num_heads=3, topk=2)
    flat = torch.tensor([[10, 20, 21, 30, 31, 40, 41]])  # root, head0 top2, head1 top2, head2 top2
    nodes = gather_node_tokens(flat, tree)
    assert nodes.tolist() == [[10, 20, 21, 30, 31, 30, 40]]
    assert gather_paths(nodes, tree).tolist() == [[[10, 20, 30, 40], [10, 20, 31, 10], [10, 21, 30, 10]]]
    logits = torch.arange(7.0).view(1, 7, 1).expand(1, 7, 3)
    assert gather_paths(logits, tree).shape == (1, 3, 4, 3)
    with pytest.raises(ValueError, match=r"\[B, 1 \+ num_heads \* topk\] = \[B, 7\]"):
        gather_node_tokens(flat[:, :5], tree)
    with pytest.raises(ValueError, match="N=7"):
        gather_paths(nodes[:, :6], tree)


def test_single_node_tree() -> None:
    tree = build_tree_buffers([[3]], num_heads=1, topk=4)
    assert torch.equal(tree.attn_mask, torch.tensor([[True, False], [True, True]]))
    assert tree.tree_indices.tolist() == [0, 4]
    assert tree.retrieve_indices.tolist() == [[0, 1]]
    assert tree.children.tolist() == [[1], [-1]]


def test_chain_choices_and_chain_tree() -> None:
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]
    tree = build_tree_buffers(chain_choices(4), num_heads=4, topk=1)
    assert torch.equal(tree.attn_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.tree_indices.tolist() == [0, 1, 2, 3, 4]
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="depth must be a positive int"):
        chain_choices(0)


def test_mc_sim_7b_63() -> None:
    assert len(MC_SIM_7B_63) == 63
    assert MC_SIM_7B_63[:6] == ((0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0))
    assert MC_SIM_7B_63[-3:] == ((0, 0, 0, 1), (1, 6), (0, 7, 0))
    assert Counter(len(p) for p in MC_SIM_7B_63) == {1: 10, 2: 28, 3: 23, 4: 2}
    tree = build_tree_buffers(MC_SIM_7B_63, num_heads=4, topk=10)  # validates: prefix-closed, ranks < 10
    assert (tree.num_nodes, tree.max_depth, tree.num_paths, tree.max_children) == (64, 4, 42, 10)
    assert tree.attn_mask.sum().item() == 1 + sum(len(p) + 1 for p in MC_SIM_7B_63)
    # every root-to-leaf row really is a chain of parents
    for row in tree.retrieve_indices.tolist():
        nodes = [n for n in row if n >= 0]
        assert [tree.parents[n].item() for n in nodes[1:]] == nodes[:-1]
    with pytest.raises(ValueError, match="rank 9 is outside"):
        build_tree_buffers(MC_SIM_7B_63, num_heads=4, topk=9)


def test_every_prefix_of_mc_sim_is_a_tree() -> None:
    for n in range(1, len(MC_SIM_7B_63) + 1):
        validate_medusa_choices(MC_SIM_7B_63[:n], num_heads=4, topk=10)
    tree = build_tree_buffers(SMALL_TREE_15, num_heads=3, topk=6)
    assert (tree.num_nodes, tree.max_depth) == (16, 3)


def test_validate_sorts_by_depth_then_path() -> None:
    assert validate_medusa_choices([[1, 0], [2], [0], [1], [0, 1]], num_heads=2, topk=3) == [
        (0,), (1,), (2,), (0, 1), (1, 0),
    ]


@pytest.mark.parametrize(
    ("choices", "num_heads", "topk", "message"),
    [
        ([], 3, 2, "medusa_choices is empty"),
        ([[0], []], 3, 2, r"medusa_choices\[1\] = \[\]: a path must not be empty"),
        ([[0], [-1]], 3, 2, r"medusa_choices\[1\] = \[-1\]: rank -1 is outside \[0, topk=2\)"),
        ([[0], [0, 2]], 3, 2, r"medusa_choices\[1\] = \[0, 2\]: rank 2 is outside \[0, topk=2\)"),
        ([[0], [0, 0], [0, 0, 0]], 2, 2, r"medusa_choices\[2\] = \[0, 0, 0\]: depth 3 exceeds num_heads=2"),
        ([[0], [1, 0]], 3, 2, r"medusa_choices\[1\] = \[1, 0\]: its prefix \[1\] is missing"),
        ([[0], [0, 1], [0, 1, 1, 0]], 4, 2, r"medusa_choices\[2\] = \[0, 1, 1, 0\]: its prefix \[0, 1, 1\]"),
        ([[0], [1], [0]], 3, 2, r"medusa_choices\[2\] = \[0\]: duplicate of medusa_choices\[0\]"),
        ([[0], [0.5]], 3, 2, r"medusa_choices\[1\] = \[0.5\]: ranks must be ints"),
        ([[0], 1], 3, 2, r"medusa_choices\[1\] = 1: a path must be a list"),
        ([[0]], 0, 2, "num_heads must be a positive int"),
        ([[0]], 1, 0, "topk must be a positive int"),
    ],
)
def test_validation_errors_name_the_path(choices: list, num_heads: int, topk: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_medusa_choices(choices, num_heads=num_heads, topk=topk)
    with pytest.raises(ValueError, match=message):
        build_tree_buffers(choices, num_heads=num_heads, topk=topk)


def test_to_device_copies_all_tensors() -> None:
    tree = build_tree_buffers(HAND_TREE, num_heads=3, topk=2, device="cpu")
    moved = tree.to("meta")
    assert moved.attn_mask.device.type == "meta" and moved.retrieve_indices.device.type == "meta"
    assert moved.paths == tree.paths and tree.attn_mask.device.type == "cpu"
