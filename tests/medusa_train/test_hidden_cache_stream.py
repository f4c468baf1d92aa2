"""The hidden-state cache streams to sealed, world-size-independent blocks: a resumed build on any number of ranks
reuses every sealed block without running the base, a damaged or unsealed block is never read and is rebuilt, the
disk is checked before any forward pass, lockstep ranks run the same number of passes, and the builder's memory does
not grow with the data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_train.files.checksums import file_sha256
from medusa_train.data.collate import Collator
from medusa_train.models.features import FINAL, target_features
from medusa_train.files.paths import REPO_ROOT
from medusa_train.files.safetensors_stream import SafetensorsStream, TensorPlan, planned_size
from medusa_train.training import hidden_cache
from medusa_train.training.hidden_cache import (
    CacheSpaceError,
    CachedHiddenDataset,
    build_hidden_cache,
    plan_block,
)
from medusa_train.training.step import FrozenBase
from tests.conftest import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "f" * 16
ROWS = 7  # with BLOCK = 2: blocks of rows {0, 1}, {2, 3}, {4, 5}, {6}
BLOCK = 2


def rows(n: int = ROWS, seed: int = 5) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (3 + (i * 5) % 7,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids[1:] + [-100]})
    return out


def count_passes(model: torch.nn.Module) -> list[int]:
    """Appends the batch size of every base forward pass to the returned list."""
    calls: list[int] = []
    model.base_model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape[0]),
                                               with_kwargs=True)
    return calls


def build(model, data, folder, **kwargs):
    kwargs = {"batch_size": 1, "block_size": BLOCK, **kwargs}
    return build_hidden_cache(FrozenBase.of(model), data, folder, split="train", fingerprint=KEY,
                              collator=Collator(pad_token_id=0), features=(FINAL, "layer1"), **kwargs)


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in sorted(folder.iterdir())}


def check_values(model, data, folder) -> None:
    dataset = CachedHiddenDataset(data, folder, split="train", fingerprint=KEY, features=(FINAL, "layer1"),
                                  block_size=BLOCK)
    with torch.no_grad():
        for i, row in enumerate(data):
            alone, _ = target_features(model.base_model, torch.tensor([row["input_ids"]]), [1])  # [1, T_i, H]
            torch.testing.assert_close(dataset[i]["hidden"], alone[FINAL][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dataset[i]["layer1"], alone["layer1"][0], atol=1e-5, rtol=1e-5)
            assert dataset[i]["base_argmax"].shape == (len(row["input_ids"]),)


def test_a_stream_writes_what_save_file_writes_and_seals_it_as_it_goes(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([7, 8], dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16)}
    plan = [TensorPlan(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with SafetensorsStream(tmp_path / "s.safetensors", plan) as out:
        for name, t in tensors.items():
            out.write(name, t)
        sha = out.close()
    assert sha == file_sha256(tmp_path / "s.safetensors")
    assert (tmp_path / "s.safetensors").stat().st_size == planned_size(plan)
    back = load_file(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    assert load_file(str(tmp_path / "ref.safetensors")).keys() == back.keys()
    with SafetensorsStream(tmp_path / "bad.safetensors", plan) as out:
        with pytest.raises(ValueError, match=r"expected tensor 'a' torch.float32 \[2, 3\], got 'b'"):
            out.write("b", tensors["b"])
        with pytest.raises(ValueError, match="3 of 3 planned tensors were not written"):
            out.close()


def test_the_greedy_targets_are_projected_a_chunk_of_positions_at_a_time(tiny_llama, tmp_path):
    data = rows()
    whole = build(tiny_llama, data, tmp_path / "whole", batch_size=2)
    projected: list[int] = []  # positions per lm_head call
    tiny_llama.lm_head.register_forward_pre_hook(lambda m, a: projected.append(a[0].numel() // a[0].shape[-1]))
    chunked = build(tiny_llama, data, tmp_path / "chunked", batch_size=2, argmax_chunk_size=3)
    assert projected and max(projected) == 3 and sum(projected) > 3 * len(data)  # several chunks a batch
    for a, b in zip(whole, chunked):
        assert load_file(a).keys() == load_file(b).keys()
        for key, value in load_file(a).items():
            assert torch.equal(value, load_file(b)[key]), key


def test_blocks_built_by_two_ranks_are_all_reused_by_one(tiny_llama, tmp_path):
    calls = count_passes(tiny_llama)
    data = rows()
    mine = [build(tiny_llama, data, tmp_path, rank=r, world_size=2) for r in range(2)]
    assert [[p.name for p in m] for m in mine] == [
        ["train-block-000000.safetensors", "train-block-000002.safetensors"],
        ["train-block-000001.safetensors", "train-block-000003.safetensors"]]
    assert len(calls) == ROWS  # batch_size 1: one pass per row
    before = snapshot(tmp_path)
    assert len(before) == 8  # 4 blocks, each with its seal
    calls.clear()
    build(tiny_llama, data, tmp_path, rank=0, world_size=1)
    assert calls == [] and snapshot(tmp_path) == before  # no base pass, not a file rewritten
    check_values(tiny_llama, data, tmp_path)
    seal = json.loads((tmp_path / "train-block-000003.json").read_text())
    assert seal["rows"] == [6, 7] and seal["sha256"] == file_sha256(tmp_path / "train-block-000003.safetensors")


def test_three_ranks_build_only_the_block_one_rank_lacks(tiny_llama, tmp_path):
    data = rows()
    build(tiny_llama, data, tmp_path)
    (tmp_path / "train-block-000002.json").unlink()  # as a run killed before it sealed block 2
    calls = count_passes(tiny_llama)
    assert [p.name for p in build(tiny_llama, data, tmp_path, rank=2, world_size=3)] == [
        "train-block-000002.safetensors"]
    assert calls == [1, 1]  # block 2's two rows
    check_values(tiny_llama, data, tmp_path)


def test_a_truncated_block_is_never_read_and_is_rebuilt(tiny_llama, tmp_path, caplog):
    data = rows()
    build(tiny_llama, data, tmp_path)
    block = tmp_path / "train-block-000001.safetensors"
    whole = block.read_bytes()
    block.write_bytes(whole[:-100])
    with pytest.raises(FileNotFoundError, match=rf"{block} is damaged: {len(whole) - 100} bytes, {len(whole)} when "
                                                "sealed; it is rebuilt"):
        CachedHiddenDataset(data, tmp_path, split="train", fingerprint=KEY, features=(FINAL, "layer1"),
                            block_size=BLOCK)
    calls = count_passes(tiny_llama)
    with caplog.at_level("WARNING", logger="medusa_train.training.hidden_cache"):
        build(tiny_llama, data, tmp_path)
    assert f"{block} is damaged" in caplog.text and calls == [1, 1]  # that block's two rows only
    assert block.read_bytes() == whole
    check_values(tiny_llama, data, tmp_path)


def test_same_size_damage_is_found_with_verify(tiny_llama, tmp_path, caplog):
    data = rows()
    build(tiny_llama, data, tmp_path)
    block = tmp_path / "train-block-000000.safetensors"
    whole = bytearray(block.read_bytes())
    whole[-8:] = b"\xff" * 8
    block.write_bytes(bytes(whole))
    calls = count_passes(tiny_llama)
    build(tiny_llama, data, tmp_path)  # by size only: reused, not read
    assert calls == []
    with caplog.at_level("WARNING", logger="medusa_train.training.hidden_cache"):
        build(tiny_llama, data, tmp_path, verify=True)
    assert f"{block} is damaged: its sha256 differs" in caplog.text and calls == [1, 1]
    assert file_sha256(block) == json.loads((tmp_path / "train-block-000000.json").read_text())["sha256"]


def test_a_build_stopped_by_sigterm_discards_its_block_keeps_the_sealed_ones_and_exits_75(tiny_llama, tmp_path,
                                                                                          monkeypatch):
    data = rows()
    passes = []

    def preempted(*args, **kwargs):
        passes.append(1)
        if len(passes) == 4:  # block 1's second batch: block 0 sealed, block 1 half written
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    real = hidden_cache._base_forward
    monkeypatch.setattr(hidden_cache, "_base_forward", preempted)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(hidden_cache.CacheBuildStopped, match="stopped on SIGTERM while building the train blocks") as e:
        build(tiny_llama, data, tmp_path)
    assert e.value.code == 75 and signal.getsignal(signal.SIGTERM) is before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-block-000000.json", "train-block-000000.safetensors"]
    monkeypatch.setattr(hidden_cache, "_base_forward", real)
    calls = count_passes(tiny_llama)
    build(tiny_llama, data, tmp_path)
    assert calls == [1] * (ROWS - BLOCK)  # every row but block 0's
    check_values(tiny_llama, data, tmp_path)


def test_the_next_build_removes_only_its_own_blocks_temporary_files(tiny_llama, tmp_path, caplog):
    data = rows()
    left = {".train-block-000000.safetensors.tmp-4242": 300, ".train-block-000002.json.tmp-17": 5,
            ".train-block-000008.safetensors.tmp-99": 10}  # rank 0 of 2 owns blocks 0, 2, 4, 6, 8 (beyond the data)
    kept = {".train-block-000001.safetensors.tmp-4242": 7,  # rank 1's block: it may be writing it right now
            ".eval-block-000000.safetensors.tmp-1": 7,  # the other split
            ".train-block-000000.safetensors.tmp-x1": 7, "train-block-000000.safetensors.tmp-1": 7,  # not ours
            ".notes.txt.tmp-3": 7}
    for name, size in {**left, **kept}.items():
        (tmp_path / name).write_bytes(b"x" * size)
    with caplog.at_level("WARNING", logger="medusa_train.training.hidden_cache"):
        build(tiny_llama, data, tmp_path, rank=0, world_size=2)
    assert f"removed {tmp_path / '.train-block-000000.safetensors.tmp-4242'} (300 bytes)" in caplog.text
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & set(left) and set(kept) <= names
    assert names - set(kept) == {f"train-block-{b:06d}.{ext}" for b in (0, 2) for ext in ("json", "safetensors")}


def test_a_build_killed_mid_block_leaves_no_block_and_no_seal(tiny_llama, tmp_path, monkeypatch):
    data = rows()
    build(tiny_llama, data, tmp_path)
    (tmp_path / "train-block-000001.json").unlink()
    passes = []

    def dies(*args, **kwargs):
        passes.append(1)
        if len(passes) == 2:
            raise KeyboardInterrupt  # killed in block 1's second batch
        return real(*args, **kwargs)

    real = hidden_cache._base_forward
    monkeypatch.setattr(hidden_cache, "_base_forward", dies)
    with pytest.raises(KeyboardInterrupt):
        build(tiny_llama, data, tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "train-block-000001.json" not in left and not [n for n in left if ".tmp-" in n]
    with pytest.raises(FileNotFoundError, match="train-block-000001.safetensors is missing"):
        CachedHiddenDataset(data, tmp_path, split="train", fingerprint=KEY, features=(FINAL, "layer1"),
                            block_size=BLOCK)


def test_too_little_disk_is_refused_before_any_pass(tiny_llama, tmp_path, monkeypatch):
    data = rows()
    folder = tmp_path / "cache"
    calls = count_passes(tiny_llama)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    H = tiny_llama.config.hidden_size
    keys = ["hidden", "layer1"]
    needed = sum(planned_size(plan_block(data, b, BLOCK, 1).tensors(keys, H, torch.float32)) for b in range(4))
    tokens = sum(len(r["input_ids"]) for r in data)
    assert needed > tokens * (2 * H * 4 + 8)  # the features, the argmax and the headers
    with pytest.raises(CacheSpaceError, match=rf"hidden cache: {folder} needs {needed:,} bytes .* for the train "
                                              r"blocks still to build but its file system has 1,000 bytes"):
        build(tiny_llama, data, folder, rank=1, world_size=2)  # every rank counts every rank's missing blocks
    assert calls == [] and list(folder.iterdir()) == []


@pytest.mark.parametrize("others", [0, 5])
def test_lockstep_pads_a_rank_to_the_most_passes_of_any_rank(tiny_llama, tmp_path, monkeypatch, others):
    data = rows()
    calls = count_passes(tiny_llama)
    monkeypatch.setattr(hidden_cache, "ranks_max", lambda value, device: max(value, others))
    build(tiny_llama, data, tmp_path, rank=1, world_size=2, lockstep=True, batch_size=2)
    assert calls[:2] == [2, 1]  # blocks 1 (rows 2, 3) and 3 (row 6)
    assert calls[2:] == [1] * (others - 2)  # padding passes up to the other ranks' 5, on one row
    calls.clear()
    build(tiny_llama, data, tmp_path, rank=1, world_size=2)  # without lockstep: nothing left, no pass
    assert calls == []


TWO_RANKS = """
import json, os, sys
import torch
import torch.distributed as dist
from tests.conftest import make_tiny_model
from tests.medusa_train.test_hidden_cache_stream import build, count_passes, rows
dist.init_process_group("gloo")
model = make_tiny_model("llama")
calls = count_passes(model)
build(model, rows(), sys.argv[1], rank=dist.get_rank(), world_size=dist.get_world_size(), lockstep=True)
dist.barrier()
with open(os.path.join(sys.argv[2], f"passes-{dist.get_rank()}"), "w") as out:  # a file each: two ranks' prints interleave
    out.write(str(len(calls)))
dist.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_in_lockstep_then_one_rank_reuses_every_block(tiny_llama, tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                           str(script), str(folder), str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    passes = [(tmp_path / f"passes-{rank}").read_text() for rank in (0, 1)]
    assert passes == ["4", "4"], done.stdout[-2000:]  # rank 0: rows 0, 1, 4, 5; rank 1: rows 2, 3, 6 and one padding pass
    before = snapshot(folder)
    calls = count_passes(tiny_llama)
    assert len(build(tiny_llama, rows(), folder)) == 4
    assert calls == [] and snapshot(folder) == before
    check_values(tiny_llama, rows(), folder)


RSS_CHILD = """
import json, sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from medusa_train.data.collate import Collator
from medusa_train.training.hidden_cache import build_hidden_cache
from medusa_train.training.step import FrozenBase

def kib(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=0,
                     num_attention_heads=4, num_key_value_heads=4)
model = LlamaForCausalLM(config).eval()
n = int(sys.argv[2])
data = [{"input_ids": [3 + (i + t) % 60 for t in range(256)], "labels": [-100] * 256} for i in range(n)]
before = kib("VmRSS:")
build_hidden_cache(FrozenBase.of(model), data, sys.argv[1], split="train", fingerprint="0" * 16,
                   collator=Collator(pad_token_id=0), batch_size=8, block_size=64)
print(json.dumps({"growth_kib": kib("VmHWM:") - before}))
"""


@pytest.mark.slow
def test_the_builder_memory_does_not_grow_with_the_rows(tmp_path):
    """100 rows of 256 tokens at H=512 in fp32 cache 52 MB, 400 rows 210 MB: a build holding its shard in memory grows
    by about twice that; the streaming one by one batch's features and logits."""
    script = tmp_path / "rss_child.py"
    script.write_text(RSS_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    growth = {}
    for n in (100, 400):
        done = subprocess.run([sys.executable, str(script), str(tmp_path / f"cache{n}"), str(n)], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        growth[n] = json.loads(done.stdout.strip().splitlines()[-1])["growth_kib"] / 1024
        assert sum(p.stat().st_size for p in (tmp_path / f"cache{n}").glob("*.safetensors")) > n * 256 * 512 * 4
    assert growth[400] < growth[100] + 25, growth  # MiB; the cache itself grew by 157 MB
