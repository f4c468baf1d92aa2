"""Faults at the users' scale, on one process: a disk that fills while the hidden cache or self-distillation writes
(a real file-size limit, ``ulimit -f``, in a subprocess) fails naming the file and the bytes, no cut block is ever
read as whole, and the rerun redoes only what the full disk cut; an empty reply from the engine and a conversation
longer than ``max_length`` are counted in the run's record; a non-UTF-8 line deep in a large JSONL is refused with
its line before any model loads."""

from __future__ import annotations

import errno
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from medusa_train.runs import drills
from medusa_train.chat.conversations import load_conversations
from medusa_train.data.self_distill import block_path, read_records, self_distill
from medusa_train.runs.disk_space import DiskFullError, disk_full_named
from medusa_train.models.features import FINAL
from medusa_train.files.paths import REPO_ROOT
from medusa_train.files.safetensors_stream import planned_size
from medusa_train.training.data_prep import read_distilled
from medusa_train.training.hidden_cache import CachedHiddenDataset, plan_block
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_hidden_cache_stream import BLOCK, KEY, build, count_passes, rows, snapshot
from tests.medusa_train.test_training import compose_train, tiny_overrides, write_jsonl, write_tiny_inputs

pytestmark = pytest.mark.usefixtures("one_thread")
self_distill_module = importlib.import_module("medusa_train.data.self_distill")  # the package exports the function
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def under_file_size_limit(limit: int, script: str, *args: object) -> subprocess.CompletedProcess:
    """``script`` (with ``args``) run by this Python with RLIMIT_FSIZE (``ulimit -f``) at ``limit`` bytes: a write
    past it fails with EFBIG (Python ignores SIGXFSZ), as a write to a full disk fails with ENOSPC."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300, preexec_fn=limit_files)


# ---- a full disk --------------------------------------------------------------------------------------------------

CACHE_SCRIPT = """
import sys
from medusa_train.runs.disk_space import DiskFullError
from tests.conftest import make_tiny_model
from tests.medusa_train.test_hidden_cache_stream import build, rows
try:
    build(make_tiny_model("llama"), rows(), sys.argv[1])
except DiskFullError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.slow  # a subprocess: about 20 s on 2 shared cores
def test_a_cache_block_cut_by_a_full_disk_is_named_never_read_and_alone_rebuilt(tiny_llama, tmp_path):
    data, folder = rows(), tmp_path / "cache"
    # rows of 3 + (5i mod 7) tokens: block 2 (rows 4 and 5, 16 tokens) is the largest; the limit lets the others by
    sizes = [planned_size(plan_block(data, b, BLOCK, 1).tensors(["hidden", "layer1"], 32, tiny_llama.dtype))
             for b in range(4)]
    limit = (max(sizes[0], sizes[1], sizes[3]) + sizes[2]) // 2
    assert max(sizes[0], sizes[1], sizes[3]) < limit < sizes[2]
    result = under_file_size_limit(limit, CACHE_SCRIPT, folder)
    assert result.returncode == 3, result.stderr[-3000:]
    block2 = folder / "train-block-000002.safetensors"
    assert f"{block2}: no room to write hidden-cache block 2 ({sizes[2]:,} bytes) and this rank's 1 blocks after it: " \
           f"it needs {sizes[2] + sizes[3]:,} bytes" in result.stdout
    assert "File too large" in result.stdout and "a rerun reuses every sealed block" in result.stdout
    # blocks 0 and 1 sealed; block 2 left nothing (its temporary file removed, no seal), block 3 never started
    assert sorted(p.name for p in folder.iterdir()) == [f"train-block-00000{b}.{ext}" for b in (0, 1)
                                                        for ext in ("json", "safetensors")]
    with pytest.raises(FileNotFoundError, match="train-block-000002.safetensors is missing"):
        CachedHiddenDataset(data, folder, split="train", fingerprint=KEY, features=(FINAL, "layer1"),
                            block_size=BLOCK)  # a reader (any rank) checks every seal before reading
    sealed = snapshot(folder)
    passes = count_passes(tiny_llama)
    build(tiny_llama, data, folder)
    assert len(passes) == 3  # rows 4, 5 and 6: blocks 2 and 3 alone
    assert {k: v for k, v in snapshot(folder).items() if k in sealed} == sealed  # blocks 0 and 1 untouched


DISTILL_SCRIPT = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from medusa_train.data.self_distill import self_distill
from medusa_train.runs.disk_space import DiskFullError
model_dir, conversations, out = sys.argv[1:4]
model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
try:
    self_distill(model, tok, json.load(open(conversations)), 4, 2, out, show_progress=False)
except DiskFullError as e:
    print(e)
    sys.exit(3)
"""


def distill_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"count from {i} to {i + 3 + i % 5}"}] for i in range(n)]


@pytest.mark.slow  # a subprocess: about 20 s on 2 shared cores
def test_self_distillation_cut_by_a_full_disk_names_the_file_and_the_rerun_generates_only_the_rest(tmp_path,
                                                                                                  monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = write_tiny_inputs(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    conversations = distill_prompts(12)
    (tmp_path / "prompts.json").write_text(json.dumps(conversations))
    whole = tmp_path / "whole" / "sd.jsonl"
    self_distill(model, tok, conversations, 4, 2, whole, show_progress=False)
    lines = block_path(whole, 0).read_bytes().splitlines(keepends=True)
    assert len(lines) == 12
    limit = len(b"".join(lines[:5])) + len(lines[5]) // 2  # the third batch's second record is cut
    out = tmp_path / "cut" / "sd.jsonl"
    result = under_file_size_limit(limit, DISTILL_SCRIPT, model_dir, tmp_path / "prompts.json", out)
    assert result.returncode == 3, result.stderr[-3000:]
    block = block_path(out, 0)
    batch = len(lines[4]) + len(lines[5])
    assert f"{block}: no room to write 2 self-distillation records (this batch's replies" in result.stdout
    assert f"it needs {batch:,} bytes" in result.stdout and "only the missing replies are generated" in result.stdout
    cut = block.read_bytes()
    assert len(cut) == limit and not cut.endswith(b"\n")  # the limit let part of the last record through
    with pytest.raises(ValueError, match=rf"{block}:6 is not a self-distillation record"):
        read_records(block)  # the cut record is never taken for a whole one

    calls: list[int] = []
    original = self_distill_module.greedy_generate
    monkeypatch.setattr(self_distill_module, "greedy_generate",
                        lambda m, prompts, *a: calls.append(len(prompts)) or original(m, prompts, *a))
    stats = self_distill(model, tok, conversations, 4, 2, out, show_progress=False)
    assert (stats.already_done, stats.generated, sum(calls)) == (5, 7, 7)
    replies = {p: {r["id"]: r["conversations"][-1]["value"] for r in read_records(block_path(p, 0))}
               for p in (whole, out)}
    assert replies[out] == replies[whole]  # the kept records and the regenerated ones: a whole run's


def test_a_disk_full_error_names_the_file_bytes_and_free_space_and_other_errors_pass(tmp_path):
    path = tmp_path / "block.bin"
    with pytest.raises(DiskFullError, match=rf"{path}: no room to write a block: it needs 1,234 bytes \(0.00 GiB\), "
                                            r"its file system has [\d,]+ bytes .* free \(No space left on device\); "
                                            r"free some"):
        with disk_full_named(path, 1234, "a block", "free some"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(PermissionError):
        with disk_full_named(path, 1234, "a block", "free some"):
            raise PermissionError(errno.EACCES, "denied")


# ---- a preemption during self-distillation -------------------------------------------------------------------------

def echo_engine(calls: list[int], on_call: dict[int, Callable[[], None]] | None = None):
    """A self-distillation engine (GenerateFn) replying to each prompt with its last 3 ids and an end of turn;
    ``on_call[n]`` runs as its n-th call begins (1-based)."""
    def generate(prompts, max_new_tokens, stop_ids):
        calls.append(len(prompts))
        (on_call or {}).get(len(calls), lambda: None)()
        return [(list(p[-3:]) + [min(stop_ids)], True) for p in prompts]
    return generate


def sigterm_from_a_thread() -> None:
    """SIGTERM sent to this process by another thread (as SLURM or torchrun send it), then the engine "works" until
    the handler, which runs on the main thread, stops it."""
    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.01)
    pytest.fail("SIGTERM did not stop the self-distillation")


def test_sigterm_during_self_distillation_keeps_every_record_written_and_exits_75(tmp_path):
    """The batch being generated when SIGTERM arrives is discarded, the batches written before are kept whole, the
    process exits with 75 as a preempted training run does, the previous handler is put back, and the rerun
    generates only the missing replies: the records then equal those of a run never stopped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_train.data.self_distill import DistillStopped

    model_dir, _ = write_tiny_inputs(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    conversations = distill_prompts(12)
    whole = tmp_path / "whole" / "sd.jsonl"
    self_distill(model, tok, conversations, 4, 4, whole, generate=echo_engine([]), show_progress=False)

    out, calls = tmp_path / "stopped" / "sd.jsonl", []
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(DistillStopped) as stopped:  # batches of 4: the third is being generated
        self_distill(model, tok, conversations, 4, 4, out, generate=echo_engine(calls, {3: sigterm_from_a_thread}),
                     show_progress=False)
    assert stopped.value.code == 75 and signal.getsignal(signal.SIGTERM) is handler
    assert str(stopped.value) == (f"stopped on SIGTERM during self-distillation into {out}'s blocks; every record "
                                  "written is kept (8 by this run): run the same command with resume=true to generate "
                                  "only the missing replies (exit code 75)")
    kept = read_records(block_path(out, 0))  # each checked against its checksum
    assert len(kept) == 8 and block_path(out, 0).read_bytes().endswith(b"\n")

    calls.clear()
    stats = self_distill(model, tok, conversations, 4, 4, out, generate=echo_engine(calls), show_progress=False)
    assert (stats.already_done, stats.generated, sum(calls)) == (8, 4, 4)
    assert read_records(block_path(out, 0)) == read_records(block_path(whole, 0))


def test_sigterm_while_a_batch_is_appended_finishes_its_records_then_stops(tmp_path, monkeypatch):
    """A signal that arrives while a batch's records are written waits for them: the batch is kept whole and
    counted, and the stop comes right after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_train.data.self_distill import DistillStopped

    model_dir, _ = write_tiny_inputs(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    original = self_distill_module._append

    def append_then_signalled(path, records):
        original(path, records[:1])
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, between the batch's records
        original(path, records[1:])

    monkeypatch.setattr(self_distill_module, "_append", append_then_signalled)
    out, calls = tmp_path / "sd.jsonl", []
    with pytest.raises(DistillStopped) as stopped:
        self_distill(model, tok, distill_prompts(12), 4, 4, out, generate=echo_engine(calls), show_progress=False)
    assert stopped.value.written == 4 and calls == [4]  # the first batch written whole; no second one asked for
    assert len(read_records(block_path(out, 0))) == 4


# ---- bad input at scale -------------------------------------------------------------------------------------------

def test_empty_replies_are_kept_on_disk_left_out_of_training_and_counted(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = write_tiny_inputs(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    conversations = distill_prompts(6)
    stop = tok.eos_token_id
    asked: list[int] = []

    def engine(prompts, max_new_tokens, stop_ids):  # a server answering some prompts with nothing
        asked.extend(range(len(asked), len(asked) + len(prompts)))
        return [([], True) if len(p) % 3 == 0 else ([stop], True) if len(p) % 3 == 1 else ([5, 6, 7, stop], True)
                for p in prompts]

    out = tmp_path / "sd.jsonl"
    stats = self_distill(model, tok, conversations, 4, 8, out, generate=engine, show_progress=False)
    records = read_records(block_path(out, 0))
    empty = sum(1 for r in records if r["conversations"][-1]["value"] == "")
    assert stats.generated == 6 and stats.empty == empty and 0 < empty < 6
    counts: dict[str, int] = {}
    distilled = read_distilled(conversations, out, counts)
    assert counts == {"no_reply": 0, "empty_reply": empty} and len(distilled) == 6 - empty
    assert all(c[-1]["content"] for c in distilled)
    again = self_distill(model, tok, conversations, 4, 8, out, generate=engine, show_progress=False)
    assert (again.already_done, again.generated, len(asked)) == (6, 0, 6)  # an empty reply is not asked again


def test_the_run_record_counts_empty_replies_and_conversations_cut_at_max_length(tmp_path, monkeypatch):
    model_dir, _ = write_tiny_inputs(tmp_path)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"conversations": [{"from": "human", "value": c[0]["content"]}]}
                                                    for c in distill_prompts(24)])  # distinct prompts
    original = self_distill_module.greedy_generate

    def some_empty(model, prompts, *args):  # every third prompt gets an empty reply
        replies = original(model, prompts, *args)
        return [([], True) if sum(p) % 3 == 0 else reply for p, reply in zip(prompts, replies)]

    monkeypatch.setattr(self_distill_module, "greedy_generate", some_empty)
    max_length = 24
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **{
        "data.self_distill": "true", "data.max_new_tokens": 16, "max_length": max_length,
        "trainer.max_steps": 2, "trainer.per_device_train_batch_size": 2})))
    recipe.run()
    record = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["training"]["data"]
    records = [r for p in sorted((tmp_path / "run" / "self_distill").glob("*.jsonl")) for r in read_records(p)]
    empty = sum(1 for r in records if r["conversations"][-1]["value"] == "")
    assert len(records) == 24 and 0 < empty < 24
    assert (record["no_reply"], record["empty_reply"]) == (0, empty)
    assert record["conversations"] == 24 - empty  # given to tokenization
    rows = [*recipe.data.train, *recipe.data.eval]
    cut = sum(1 for r in rows if len(r["input_ids"]) == max_length)
    assert record["at_max_length"] == cut > 0
    assert record["train_conversations"] + record["eval_conversations"] == len(rows)
    assert record["load_dropped"]["records"] == 24 and record["load_dropped"]["malformed"] == 0


def test_a_non_utf8_line_deep_in_a_500k_line_jsonl_is_refused_with_its_line_before_any_model_loads(tmp_path):
    # the project's convention for a malformed file (medusa_train.files.text_files): refuse it whole, naming the line, at
    # load time: the model, self-distillation and training all start later
    path = tmp_path / "big.jsonl"
    line = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    good = (line + "\n").encode()
    bad_line = 499_000
    with path.open("wb") as f:
        f.write(good * (bad_line - 1))
        f.write(line.replace("hello", "caf\xe9").encode("latin-1") + b"\n")
        f.write(good * 1_000)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^{path}:{bad_line}: not UTF-8 text: byte 0xe9 .* save the file as UTF-8"):
        load_conversations("json", path)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("name", [drills.EXIT_AT_CACHE_BLOCK, drills.EXIT_AT_DISTILL_BATCH])
def test_the_data_drills_parse_like_the_training_ones(name, monkeypatch):
    monkeypatch.setenv(name, "2:x")
    with pytest.raises(ValueError, match=name):
        drills.exit_if_drilled(name, 2, 0)
    monkeypatch.setenv(name, "2:1")
    drills.exit_if_drilled(name, 2, 0)  # another rank's drill: this one goes on
    drills.exit_if_drilled(name, 1, 1)  # another count
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=name):
        drills.check_drills()  # what a run calls first
