"""benchmarks/llamacpp_near_ties.py: which speculative llama.cpp rows left the plain row's reply, where, and the
top-2 probabilities read from llama-server's answer (the server itself runs in the benchmark)."""

import importlib.util
import math
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def ties():
    path = REPO_ROOT / "benchmarks" / "llamacpp_near_ties.py"
    spec = importlib.util.spec_from_file_location("llamacpp_near_ties", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(prompt_id, decoder, tokens, turn=1):
    return {"prompt_id": prompt_id, "decoder": decoder, "tokens": tokens, "turn": turn, "prompt_tokens": 7}


def test_the_first_difference_of_two_replies(ties):
    assert ties.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ties.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ties.first_difference([1, 2], [1, 2, 3]) == 2


def test_only_speculative_llamacpp_rows_that_left_the_plain_reply_are_listed(ties):
    rows = [row("a", "llamacpp", [1, 2, 3, 4]), row("a", "llamacpp_draft", [1, 2, 9, 4]),
            row("a", "llamacpp_ngram", [1, 2, 3, 4]), row("a", "vanilla", [1, 8, 3, 4]),
            row("b", "llamacpp", [5, 6]), row("b", "llamacpp_ngram", [5, 6, 7]),  # longer only: no token differs
            row("a", "llamacpp_draft", [0], turn=2)]
    assert ties.divergences(rows) == [{"prompt_id": "a", "decoder": "llamacpp_draft", "index": 2, "plain_token": 3,
                                       "other_token": 9, "prompt_tokens": 7}]


def test_top_two_reads_llamacpps_log_probabilities(ties):
    entry = {"id": 3, "logprob": -0.69, "top_logprobs": [{"id": 3, "token": "x", "logprob": math.log(0.51)},
                                                          {"id": 9, "token": "y", "logprob": math.log(0.48)}]}
    assert [(t, round(p, 4)) for t, p in ties.top_two(entry)] == [(3, 0.51), (9, 0.48)]
    with pytest.raises(ValueError, match="top_logprobs"):
        ties.top_two({"id": 3, "probs": []})
