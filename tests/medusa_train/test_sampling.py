from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from medusa_train.files.paths import REPO_ROOT
from medusa_train.tree.sampling import greedy_tokens, is_greedy, logits_to_probs


def test_temperature_only_is_softmax_of_scaled_logits() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert torch.allclose(logits_to_probs(logits, 1.0), torch.tensor([0.5, 0.25, 0.25]))
    # T = 2: p ∝ sqrt(p) = [sqrt(.5), .5, .5]
    z = math.sqrt(0.5) + 1.0
    assert torch.allclose(logits_to_probs(logits, 2.0), torch.tensor([math.sqrt(0.5) / z, 0.5 / z, 0.5 / z]))


def test_output_is_float32_and_keeps_leading_dims() -> None:
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = logits_to_probs(logits, 0.7, top_k=4, top_p=0.9)
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 11)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 4).all()


def test_top_k_keeps_ties_with_kth() -> None:
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert (probs > 0).tolist() == [True, False, True, True, False]
    assert torch.allclose(probs, torch.softmax(torch.tensor([3.0, -math.inf, 2.0, 2.0, -math.inf]), -1))
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=50), logits_to_probs(logits, 1.0))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.1, [True, False, False, False]),  # the top token alone already has mass >= top_p
        (0.49, [True, False, False, False]),
        (0.51, [True, True, False, False]),
        (0.79, [True, True, False, False]),
        (0.81, [True, True, True, False]),
        (1.0, [True, True, True, True]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, kept: list[bool]) -> None:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    probs = logits_to_probs(torch.log(base), 1.0, top_p=top_p)
    assert (probs > 0).tolist() == kept
    mask = torch.tensor(kept)
    assert torch.allclose(probs.double(), torch.where(mask, base, 0.0) / base[mask].sum(), atol=1e-6)


def test_top_k_then_top_p_order() -> None:
    # top-k=2 leaves [0.625, 0.375]; top_p=0.6 then keeps only the first (HF applies top-k before top-p)
    base = torch.tensor([0.5, 0.3, 0.2])
    assert (logits_to_probs(torch.log(base), 1.0, top_k=2, top_p=0.6) > 0).tolist() == [True, False, False]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 20, 0.75)])
def test_matches_hugging_face_warpers(temperature: float, top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    assert torch.allclose(logits_to_probs(logits, temperature, top_k=top_k, top_p=top_p), expected, atol=1e-6)


def test_is_greedy() -> None:
    assert is_greedy(0) and is_greedy(0.0)
    assert not is_greedy(0.7)
    with pytest.raises(ValueError, match="temperature"):
        is_greedy(-1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be finite and > 0"),
        ({"temperature": -0.5}, "temperature must be finite and > 0"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": 1.0, "top_k": -1}, "top_k must be an int >= 0"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k must be an int >= 0"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        logits_to_probs(torch.zeros(4), **kwargs)


def test_integer_logits_raise() -> None:
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        logits_to_probs(torch.zeros(4, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax_first_index_among_ties(dtype) -> None:
    logits = (torch.randn(8, 6, 500, generator=torch.Generator().manual_seed(0)) * 3).round().to(dtype)  # many ties
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=dtype)).tolist() == [1]


CHANGED_DEFAULTS = """
import dataclasses, inspect, json
import medusa_train.tree.sampling as sampling
sampling.SAMPLING_DEFAULTS = sampling.SamplingDefaults(temperature=0.5, top_p=0.9, top_k=7, max_new_tokens=99)
from inference.cli.generate import GenerateConfig
from inference.decoders.base import DecodeConfig
from inference.evaluation.eval_config import EvaluateConfig
from medusa_train.engines.vllm_env import VllmWorker
found = {}
for cls in (DecodeConfig, GenerateConfig, EvaluateConfig):
    found[cls.__name__] = {f.name: f.default for f in dataclasses.fields(cls)
                           if f.name in ("temperature", "top_p", "top_k", "max_new_tokens")
                           and f.default is not dataclasses.MISSING}
found["VllmWorker.generate"] = {k: p.default for k, p in inspect.signature(VllmWorker.generate).parameters.items()
                                if k in ("temperature", "top_p", "top_k")}
print(json.dumps(found))
"""


def test_every_sampling_default_comes_from_the_one_record() -> None:
    """The request, medusa-generate's and medusa-eval's settings and the vLLM engine call take their sampling defaults
    from ``SAMPLING_DEFAULTS``: another record there changes all of them (a fresh interpreter replaces it before the
    others are defined)."""
    run = subprocess.run([sys.executable, "-c", CHANGED_DEFAULTS], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 7}
    assert found["DecodeConfig"] == sampling  # its max_new_tokens has no default: every request gives its own
    assert found["GenerateConfig"] == found["EvaluateConfig"] == {**sampling, "max_new_tokens": 99}
    assert found["VllmWorker.generate"] == sampling
