"""Tokenization through ``datasets.map(batched=True)``, cached on disk once per node: the same ids, labels, skips
and split as tokenizing conversation by conversation in Python, a folder reused while its key matches, and one
writer per node while the other ranks wait and load it."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from medusa_train.data import build_dataset, tokenize_conversation
from medusa_train.data import dataset as dataset_module
from medusa_train.data.split import split_indices
from medusa_train.data.tokenize import IGNORE_INDEX, ConversationSkipped
from medusa_train.data.tokenized_cache import COMPLETE
from tests.medusa_train.test_data import all_fixture_conversations, make_bpe_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


def small_set() -> list:
    """The fixtures, 3 of them repeated (duplicates), one prompt too long for 64 tokens, one with no reply."""
    conversations = all_fixture_conversations()
    return [*conversations, *conversations[:3], [{"role": "user", "content": "word " * 300},
                                                  {"role": "assistant", "content": "ok"}],
            [{"role": "user", "content": "no reply"}]]


def reference(tok, conversations, max_length, eval_fraction, seed):
    """What tokenization did before (one process, Python lists): each conversation tokenized alone, skips by
    reason, repeats of earlier tokens skipped as duplicates, then the seeded split."""
    rows, seen, skipped = [], set(), Counter()
    for c in conversations:
        try:
            row = tokenize_conversation(tok, c, max_length)
        except ConversationSkipped as e:
            rows.append(None)
            skipped[e.reason] += 1
            continue
        key = tuple(row["input_ids"])
        rows.append(None if key in seen else row)
        skipped["duplicate"] += key in seen
        seen.add(key)
    train_idx, eval_idx = split_indices(len(conversations), eval_fraction, seed)
    kept = [r for r in rows if r is not None]
    return ([rows[i] for i in train_idx if rows[i] is not None], [rows[i] for i in eval_idx if rows[i] is not None],
            {k: v for k, v in skipped.items() if v}, sum(len(r["input_ids"]) for r in kept),
            sum(sum(x != IGNORE_INDEX for x in r["labels"]) for r in kept))


@pytest.mark.parametrize("cached", [False, True])
def test_the_same_ids_labels_skips_and_split_as_tokenizing_one_by_one(tok, tmp_path, cached):
    conversations = small_set()
    train, held, stats = build_dataset(tok, conversations, 64, 0.25, seed=3,
                                       cache_dir=tmp_path / "tokenized" if cached else None)
    ref_train, ref_held, ref_skipped, ref_tokens, ref_labels = reference(tok, conversations, 64, 0.25, 3)
    assert list(train) == ref_train and list(held) == ref_held
    assert stats.skipped == ref_skipped == {"duplicate": 3, "prompt_too_long": 1, "no_assistant_turn": 1}
    assert (stats.tokens, stats.label_tokens, stats.kept) == (ref_tokens, ref_labels, len(ref_train) + len(ref_held))
    assert train.column_names == ["input_ids", "labels"]
    assert (len(list((tmp_path / "tokenized").iterdir())) if cached else 0) == int(cached)


@pytest.mark.slow  # worker processes: a few seconds to start
def test_several_processes_tokenize_the_same_rows(tok, tmp_path):
    conversations = small_set()
    one = build_dataset(tok, conversations, 64, 0.25, seed=3, num_proc=1)
    two = build_dataset(tok, conversations, 64, 0.25, seed=3, num_proc=2, cache_dir=tmp_path)
    assert list(one[0]) == list(two[0]) and list(one[1]) == list(two[1]) and one[2] == two[2]


def test_the_folder_is_reused_while_its_key_matches(tok, tmp_path, monkeypatch):
    conversations = small_set()
    first = build_dataset(tok, conversations, 64, 0.0, seed=0, cache_dir=tmp_path)
    calls = []
    real = dataset_module.tokenize_table
    monkeypatch.setattr(dataset_module, "tokenize_table", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    again = build_dataset(tok, conversations, 64, 0.0, seed=0, cache_dir=tmp_path)
    assert calls == [] and list(again[0]) == list(first[0])  # read back, not tokenized again
    build_dataset(tok, conversations, 48, 0.0, seed=0, cache_dir=tmp_path)  # another max_length: another key
    changed = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "changed"}], *conversations]
    build_dataset(tok, changed, 64, 0.0, seed=0, cache_dir=tmp_path)  # other data: another key
    assert calls == [48, 64]
    folders = sorted(tmp_path.iterdir())
    assert len(folders) == 3 and all((f / COMPLETE).is_file() for f in folders)  # no temporary folder left


def test_the_local_main_process_tokenizes_once_and_the_other_rank_loads_it(tok, tmp_path, monkeypatch):
    conversations = small_set()
    calls = []
    real = dataset_module.tokenize_table
    monkeypatch.setattr(dataset_module, "tokenize_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    barrier, results = threading.Barrier(2, timeout=120), {}

    def rank(local_rank: int) -> None:
        results[local_rank] = build_dataset(tok, conversations, 64, 0.25, seed=3, cache_dir=tmp_path,
                                            local_main=local_rank == 0, barrier=barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]  # the waiting rank starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert calls == [1]
    assert list(results[0][0]) == list(results[1][0]) and results[0][2] == results[1][2]
    assert results[1][0].cache_files  # memory-mapped from the folder, not a copy in memory
