"""Self-distillation's blocks do not depend on the world size: replies written by two ranks are all reused by one
(nothing generated, no file rewritten), and an earlier version's per-rank files are copied into the blocks."""

from __future__ import annotations

import json

import pytest

from medusa_train.checksums import file_sha256
from medusa_train.data import self_distill
from medusa_train.data.self_distill import _record, block_path, read_records, record_id, written_blocks
from medusa_train.training.data_prep import read_distilled
from tests.conftest import make_tiny_model, make_tiny_tokenizer

EOS = 2  # <|im_end|> of the tiny tokenizer
PROMPTS = [f"Question {i}?" for i in range(7)]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok):
    return make_tiny_model("llama", vocab_size=len(tok))


def conversations() -> list:
    return [[{"role": "user", "content": p}] for p in PROMPTS]


class Engine:
    """A deterministic engine that records the prompts it was asked to answer."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def __call__(self, prompts, max_new_tokens, stops):
        self.asked += prompts
        return [([10 + len(p) % 50, 11 + p[-1] % 50, EOS], True) for p in prompts]


def run(tiny, tok, out, engine, rank=0, world_size=1):
    return self_distill(tiny, tok, conversations(), 8, 3, out, rank, world_size, generate=engine, show_progress=False,
                        block_size=2)


def test_blocks_written_by_two_ranks_are_all_reused_by_one(tiny, tok, tmp_path):
    out = tmp_path / "sd.jsonl"
    engine = Engine()
    stats = [run(tiny, tok, out, engine, rank, 2) for rank in range(2)]
    assert [[p.name for p in s.paths] for s in stats] == [
        ["sd.block000000.jsonl", "sd.block000002.jsonl"], ["sd.block000001.jsonl", "sd.block000003.jsonl"]]
    assert len(engine.asked) == 7 and [s.generated for s in stats] == [4, 3]
    before = {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in written_blocks(out)}
    assert len(before) == 4
    engine.asked.clear()
    again = run(tiny, tok, out, engine)
    assert engine.asked == [] and (again.already_done, again.generated) == (7, 0)
    assert {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in written_blocks(out)} == before
    distilled = read_distilled(conversations(), out)
    assert [c[0]["content"] for c in distilled] == PROMPTS
    # three ranks: still nothing to generate
    assert sum(run(tiny, tok, out, engine, rank, 3).generated for rank in range(3)) == 0 and engine.asked == []


def test_an_earlier_versions_rank_files_are_copied_into_the_blocks(tiny, tok, tmp_path):
    out = tmp_path / "sd.jsonl"
    for rank in range(2):  # the layout earlier versions wrote: conversation i in sd.rank{i % 2}-of-2.jsonl
        records = [_record(i, record_id(c), c, f"old reply {i}", 3, True)
                   for i, c in enumerate(conversations()) if i % 2 == rank and i != 5]
        (tmp_path / f"sd.rank{rank}-of-2.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    engine = Engine()
    stats = run(tiny, tok, out, engine)
    assert (stats.migrated, stats.generated) == (6, 1) and len(engine.asked) == 1  # conversation 5 had no reply
    replies = {r["source_index"]: r["conversations"][-1]["value"] for p in written_blocks(out) for r in read_records(p)}
    assert replies[0] == "old reply 0" and replies[6] == "old reply 6" and not replies[5].startswith("old")
    assert sorted(replies) == list(range(7)) and block_path(out, 3).is_file()
    engine.asked.clear()
    assert run(tiny, tok, out, engine).migrated == 0 and engine.asked == []  # copied once
