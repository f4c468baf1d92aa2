"""Paired-bootstrap intervals of speed ratios (inference/evaluation/intervals.py)."""

from __future__ import annotations

import pytest
import torch

from inference.evaluation.intervals import paired_interval, ratio_interval


def test_a_constant_ratio_has_no_noise():
    tokens = [10, 20, 30, 40]
    interval = ratio_interval(tokens, [1.0, 2.0, 3.0, 4.0], tokens, [2.0, 4.0, 6.0, 8.0])
    assert interval.estimate == pytest.approx(2.0)
    assert interval.low == pytest.approx(2.0) and interval.high == pytest.approx(2.0)
    assert interval.separated and interval.turns == 4 and interval.describe() == "2.00x [2.00, 2.00]"


def test_the_estimate_is_the_ratio_of_summed_speeds_and_the_interval_straddles_it():
    # a: 60 tokens in 5 s (12/s); b: 60 tokens in 6 s (10/s) -> 1.2, from turns that disagree
    interval = ratio_interval([10, 20, 30], [0.5, 2.5, 2.0], [10, 20, 30], [1.0, 2.0, 3.0])
    assert interval.estimate == pytest.approx(1.2)
    assert interval.low < 1.0 < 1.2 < interval.high  # one turn slower, two faster: not beyond the noise
    assert not interval.separated
    assert ratio_interval([10, 20, 30], [0.5, 2.5, 2.0], [10, 20, 30], [1.0, 2.0, 3.0]) == interval  # seeded
    assert interval.record()["separated"] is False


def test_the_interval_covers_the_true_ratio_about_as_often_as_its_level():
    generator = torch.Generator().manual_seed(1)
    covered, runs = 0, 200
    for _ in range(runs):
        tokens = torch.randint(20, 200, (16,), generator=generator).double()
        base = tokens / 10.0  # 10 tokens/s
        noise_a = torch.exp(0.15 * torch.randn(16, generator=generator, dtype=torch.float64))
        noise_b = torch.exp(0.15 * torch.randn(16, generator=generator, dtype=torch.float64))
        interval = ratio_interval(tokens.tolist(), (base / 1.25 * noise_a).tolist(), tokens.tolist(),
                                  (base * noise_b).tolist(), resamples=500)
        covered += interval.low <= 1.25 <= interval.high
    assert 0.85 <= covered / runs <= 0.99  # the percentile bootstrap runs a little narrow on 16 turns


def test_rows_are_paired_by_turn():
    units = [{"medusa": {"new_tokens": 10, "wall_time_s": 1.0}, "vanilla": {"new_tokens": 10, "wall_time_s": 1.5}},
             {"medusa": {"new_tokens": 20, "wall_time_s": 2.0}, "vanilla": {"new_tokens": 20, "wall_time_s": 3.0}}]
    interval = paired_interval(units, "medusa", "vanilla")
    assert interval.estimate == pytest.approx(1.5) and interval.low == pytest.approx(1.5) and interval.turns == 2


@pytest.mark.parametrize("args, kwargs, match", [
    (([1], [1.0], [1, 2], [1.0, 1.0]), {}, "differ in length"),
    (([], [], [], []), {}, "no turn"),
    (([1], [0.0], [1], [1.0]), {}, "wall time"),
    (([1], [1.0], [1], [1.0]), {"level": 1.0}, "level"),
    (([1], [1.0], [1], [1.0]), {"resamples": 0}, "resamples"),
])
def test_bad_input_is_named(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ratio_interval(*args, **kwargs)


def test_one_turn_has_no_interval_and_is_never_beyond_the_noise():
    interval = ratio_interval([10], [1.0], [10], [2.0])
    assert interval.estimate == pytest.approx(2.0) and interval.low is None and interval.high is None
    assert not interval.separated and interval.describe() == "2.00x [n/a]"
