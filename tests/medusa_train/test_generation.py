"""Batching prompts for greedy generation: similar lengths together, and a padded-token budget."""

from __future__ import annotations

import pytest

from medusa_train.models.generation import left_pad, length_batches


def test_length_batches_groups_longest_first_within_the_row_and_token_limits():
    lengths = [5, 120, 7, 3000, 6, 110]
    assert length_batches(lengths, batch_size=2) == [[3, 1], [5, 2], [4, 0]]
    # 3000 padded tokens alone fill a 4096 budget: the long prompt goes alone, the rest share (4 x 120 <= 4096)
    assert length_batches(lengths, batch_size=16, max_tokens=4096) == [[3], [1, 5, 2, 4, 0]]
    # a budget of 230 tokens: 120 + 110 padded to 2 x 120 = 240 does not fit
    assert length_batches(lengths, batch_size=16, max_tokens=230) == [[3], [1], [5, 2], [4, 0]]
    assert length_batches([], batch_size=4) == []


def test_length_batches_rejects_bad_limits():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        length_batches([1], batch_size=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        length_batches([1], batch_size=1, max_tokens=0)


def test_left_pad_right_aligns_prompts_and_masks_the_padding():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0, device="cpu")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
