"""Choosing training conversations for a code model: a share of code conversations (``data.code_share``) and the
evaluation problems left out (``data.exclude_prompts=[humaneval]``), counted in the load statistics."""

from __future__ import annotations

import functools
import json

import pytest

from medusa_train.config.schema import DataConfig
from medusa_train.chat.conversations import load_conversations
from medusa_train.data.topics import holds_problem, looks_like_code
from medusa_train.chat.prompts import problem_signatures


def conversation(user: str, reply: str = "ok") -> dict:
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}


@pytest.mark.parametrize("text, code", [
    ("Write a python function that reverses a list", True), ("```\nx = 1\n```\nwhat does this print?", True),
    ("def f(x):\n    return x\nexplain it", True), ("import numpy as np\nwhy is it slow", True),
    ("How do I fix this SQL query?", True), ("Write a poem about the sea", False),
    ("What is the capital of France?", False), ("Tell me a story about a dragon and a knight", False),
])
def test_a_first_turn_looks_like_code_when_it_shows_or_asks_for_it(text, code):
    assert looks_like_code([{"role": "user", "content": text}, {"role": "assistant", "content": "```x```"}]) is code


def test_the_share_of_code_and_the_excluded_problems(tmp_path):
    records = [conversation(f"chat {i}") if i % 3 else conversation(f"write python code number {i}")
               for i in range(30)]  # code at 0, 3, 6, ...: 10 of 30
    records[6] = conversation("def has_close_elements(numbers, threshold):\n  fix this python")
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(records))
    exclude = functools.partial(holds_problem, signatures=("def has_close_elements(",))
    kept, stats = load_conversations("json", path, max_conversations=8, topic=looks_like_code, topic_share=0.5,
                                     exclude=exclude)
    users = [c[0]["content"] for c in kept]
    assert users == ["write python code number 0", "chat 1", "chat 2", "write python code number 3", "chat 4",
                     "chat 5", "write python code number 9", "write python code number 12"]  # file order, 4 + 4
    assert (stats.on_topic, stats.excluded, stats.kept) == (4, 1, 8)
    assert stats.over_share == 4  # chat 7, 8, 10, 11: the other half was full
    assert "kept 8 (4 on topic, 4 passed over for the share), 1 excluded" in stats.summary()
    kept, stats = load_conversations("json", path, max_conversations=8)  # no topic: file order
    assert [c[0]["content"] for c in kept][:2] == ["write python code number 0", "chat 1"] and stats.on_topic == 0


def test_humaneval_signatures_and_the_settings_checked():
    signatures = problem_signatures(["humaneval"])
    assert len(signatures) == 158 and signatures[0] == "def has_close_elements("  # 164 problems, 6 names repeat
    assert holds_problem([{"role": "user", "content": "x = 1\ndef has_close_elements(a, b):"}], signatures)
    with pytest.raises(ValueError, match=r"data.exclude_prompts: 'mt_bench' cannot be excluded; choose from humaneval"):
        problem_signatures(["mt_bench"])
    with pytest.raises(ValueError, match=r"data.exclude_prompts: \['gsm8k'\] cannot be excluded"):
        DataConfig(exclude_prompts=["gsm8k"]).validate()
    with pytest.raises(ValueError, match=r"data.code_share picks the code conversations among data.max_conversations"):
        DataConfig(code_share=0.5).validate()
    with pytest.raises(ValueError, match=r"data.code_share must be"):
        DataConfig(code_share=1.5, max_conversations=10).validate()
    DataConfig(code_share=0.5, max_conversations=10, exclude_prompts=["humaneval"]).validate()
