"""llama2.c conversion: stories260K reproduces its reference story, matches an independent llama2.c-style forward
pass, its tokenizer matches llama2.c's encode() and round-trips, and bad files fail early with clear messages."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from medusa_train.loading import llama2c
from medusa_train.loading.llama2c import (
    Llama2cHeader,
    load_llama2c_model,
    load_llama2c_tokenizer,
    read_llama2c_header,
    read_llama2c_weights,
)
from medusa_train.files.paths import assets_dir

REFERENCE_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    " leading space,  double  spaces and a trailing one ",
    "Digits 0123456789; punctuation: (a) [b] {c}? !x! - 50% & $3 * 2 + 1 = 7 ~ | \\ /",
    "line one\nline two\n\n\ttabbed",
    "Café, naïve, jalapeño, 日本語 and an emoji 🙂",
    "Tom's \u201cbig\u201d dog\u2014ran\u2026",
    "",
]


@pytest.fixture(scope="module")
def stories_dir() -> Path:
    return assets_dir() / "stories260K"


@pytest.fixture(scope="module")
def model(stories_dir: Path) -> LlamaForCausalLM:
    return load_llama2c_model(stories_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):
    return load_llama2c_tokenizer(stories_dir / "tok512.bin")


# ---------------------------------------------------------------- independent llama2.c references (run.c, in Python)


def _read_pieces(path: Path) -> tuple[list[bytes], list[float]]:
    data = path.read_bytes()
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8 : offset + 8 + length])
        scores.append(score)
        offset += 8 + length
    return pieces, scores


def _llama2c_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """llama2.c ``run.c:encode`` with bos=1, eos=0: dummy prefix, code points or bytes+3, best-score merges."""
    lookup = {p: i for i, p in enumerate(pieces)}
    tokens = [1]
    if text:
        tokens.append(lookup[b" "])
    for ch in text:
        b = ch.encode("utf-8")
        tokens.extend([lookup[b]] if b in lookup else [x + 3 for x in b])
    while True:
        best: tuple[float, int, int] | None = None
        for i in range(len(tokens) - 1):
            j = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if j is not None and (best is None or scores[j] > best[0]):  # strict: leftmost wins ties
                best = (scores[j], i, j)
        if best is None:
            return tokens
        _, i, j = best
        tokens[i : i + 2] = [j]


def _reference_logits(header: Llama2cHeader, raw: dict[str, np.ndarray], tokens: list[int]) -> torch.Tensor:
    """llama2.c's forward in float64 on the raw (unpermuted) arrays, interleaved-pair RoPE. Returns (T, V)."""
    w = {k: torch.from_numpy(np.array(v)).double() for k, v in raw.items()}
    T, D, nh, nkv = len(tokens), header.head_dim, header.n_heads, header.n_kv_heads
    freqs = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs  # (T, D/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # (T, 1, D/2)

    def rope(v: torch.Tensor) -> torch.Tensor:  # (T, heads, D), pairs (2i, 2i+1)
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(v.shape)

    def rms(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5) * g

    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    x = w["token_embedding"][tokens]  # (T, H)
    for layer in range(header.n_layers):
        h = rms(x, w["rms_att"][layer])
        q = rope((h @ w["wq"][layer].T).reshape(T, nh, D))
        k = rope((h @ w["wk"][layer].T).reshape(T, nkv, D)).repeat_interleave(nh // nkv, dim=1)
        v = (h @ w["wv"][layer].T).reshape(T, nkv, D).repeat_interleave(nh // nkv, dim=1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D) + mask).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(T, -1) @ w["wo"][layer].T
        h = rms(x, w["rms_ffn"][layer])
        x = x + (torch.nn.functional.silu(h @ w["w1"][layer].T) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rms(x, w["rms_final"]) @ w.get("wcls", w["token_embedding"]).T


def _write_checkpoint(path: Path, header: Llama2cHeader, seed: int = 0) -> None:
    """A random llama2.c checkpoint with this header (negative vocab_size in the file when not shared)."""
    gen = np.random.default_rng(seed)
    vocab = header.vocab_size if header.shared_classifier else -header.vocab_size
    values = (header.dim, header.hidden_dim, header.n_layers, header.n_heads, header.n_kv_heads, vocab)
    with path.open("wb") as f:
        f.write(struct.pack("<7i", *values, header.max_seq_len))
        for name, shape in header.array_shapes().items():
            noise = gen.standard_normal(shape)
            array = 1.0 + 0.1 * noise if name.startswith("rms") else 0.3 * noise
            f.write(array.astype("<f4").tobytes())


# ---------------------------------------------------------------------------------------------------- the model


def test_header_of_stories260k(stories_dir: Path) -> None:
    header = read_llama2c_header(stories_dir / "stories260K.bin")
    assert header == Llama2cHeader(
        dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, shared_classifier=True,
        max_seq_len=512,
    )
    assert header.expected_file_bytes() == 1_056_540


def test_config_of_converted_model(model: LlamaForCausalLM) -> None:
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 172, 5)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (8, 4, 8, 512)
    assert (c.rms_norm_eps, c.rope_parameters["rope_theta"], c.max_position_embeddings) == (1e-5, 10000.0, 512)
    assert (c.bos_token_id, c.eos_token_id, c.tie_word_embeddings) == (1, 2, True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not model.training
    # the file's 264,128 floats less the two 512x4 RoPE tables
    assert sum(p.numel() for p in model.parameters()) == 260_032


def test_stored_rope_tables_are_theta_10000(stories_dir: Path) -> None:
    header, raw = read_llama2c_weights(stories_dir / "stories260K.bin")
    freqs = 1.0 / 10000.0 ** (np.arange(0, header.head_dim, 2) / header.head_dim)
    angles = np.arange(header.max_seq_len)[:, None] * freqs
    np.testing.assert_allclose(raw["freq_cis_real"], np.cos(angles), atol=1e-4)
    np.testing.assert_allclose(raw["freq_cis_imag"], np.sin(angles), atol=1e-4)


def test_greedy_from_bos_reproduces_reference_story(model: LlamaForCausalLM, tokenizer) -> None:
    out = model.generate(torch.tensor([[1]]), max_new_tokens=50, do_sample=False, pad_token_id=2)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith(REFERENCE_STORY), text
    # token for token: the reference text re-encoded by the tokenizer is exactly what the model produced
    expected = tokenizer(REFERENCE_STORY).input_ids
    assert out[0, : len(expected)].tolist() == expected
    assert expected[:6] == [1, 403, 407, 261, 378, 432]  # <s> ▁Once ▁upon ▁a ▁time ,


def test_matches_llama2c_reference_forward(model: LlamaForCausalLM, stories_dir: Path) -> None:
    header, raw = read_llama2c_weights(stories_dir / "stories260K.bin")
    tokens = model.generate(torch.tensor([[1]]), max_new_tokens=20, do_sample=False, pad_token_id=2)[0].tolist()
    reference = _reference_logits(header, raw, tokens)  # (21, V)
    # one causal pass stands for 20 greedy steps: the reference's argmax at each position is the next HF token
    assert reference[:-1].argmax(-1).tolist() == tokens[1:]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_unshared_classifier_and_non_square_gqa(tmp_path: Path) -> None:
    header = Llama2cHeader(
        dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, shared_classifier=False,
        max_seq_len=32,
    )
    path = tmp_path / "tiny.bin"
    _write_checkpoint(path, header)
    assert read_llama2c_header(path) == header
    m = load_llama2c_model(path)
    assert m.config.tie_word_embeddings is False
    assert m.config.max_position_embeddings == 32
    assert not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)
    tokens = [1, 7, 39, 3, 3, 20, 11, 0, 5]
    with torch.no_grad():
        logits = m(torch.tensor([tokens])).logits[0].double()
    _, raw = read_llama2c_weights(path)
    torch.testing.assert_close(logits, _reference_logits(header, raw, tokens), atol=1e-4, rtol=1e-4)


def test_dtype_and_save_reload(stories_dir: Path, model: LlamaForCausalLM, tmp_path: Path) -> None:
    bf16 = load_llama2c_model(stories_dir / "stories260K.bin", dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 403, 407, 261, 378, 432]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        load_llama2c_model(stories_dir / "stories260K.bin", dtype=torch.int8)


# ------------------------------------------------------------------------------------------------ the tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_llama2c_encode_and_round_trips(tokenizer, stories_dir: Path, text: str) -> None:
    pieces, scores = _read_pieces(stories_dir / "tok512.bin")
    ids = tokenizer(text).input_ids
    assert ids == _llama2c_encode(text, pieces, scores)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_known_encodings(tokenizer) -> None:
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.pad_token is None
    assert tokenizer("Once upon a time").input_ids == [1, 403, 407, 261, 378]
    assert tokenizer("Once upon a time", add_special_tokens=False).input_ids == [403, 407, 261, 378]
    # a leading space keeps the dummy prefix, as sentencepiece and llama2.c do (Metaspace would drop it)
    assert tokenizer.tokenize(" hi") == ["▁", "▁h", "i"]
    # newline and 日 (E6 97 A5) fall back to bytes; é is a vocabulary piece
    assert tokenizer.tokenize("a\né日") == ["▁a", "<0x0A>", "é", "<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.decode([1, 403, 407, 2]) == "<s> Once upon</s>"
    assert len(tokenizer) == 512


def test_chat_template_concatenates_turns(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time."},
        {"role": "user", "content": "More!"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<s>Tell me a story.\nOnce upon a time.</s>\nMore!"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>Tell me a story.\n"
    out = tokenizer.apply_chat_template(
        messages[:2], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] == 1 and ids.count(1) == 1 and ids[-1] == 2
    assistant_ids = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(assistant_ids) == "Once upon a time.</s>"


def test_tokenizer_survives_save_and_auto_reload(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = reloaded(text).input_ids
        assert ids == tokenizer(text).input_ids
        assert reloaded.decode(ids, skip_special_tokens=True) == text
    assert reloaded.chat_template == llama2c.CHAT_TEMPLATE


# ------------------------------------------------------------------------------------------------------- errors


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_llama2c_model(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match="tokenizer .*tok.bin"):
        load_llama2c_tokenizer(tmp_path / "tok.bin")


def test_size_mismatch_fails_before_reading_weights(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = (stories_dir / "stories260K.bin").read_bytes()

    def no_weight_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read before the file was validated")

    monkeypatch.setattr(llama2c.np, "fromfile", no_weight_reads)
    truncated = _write(tmp_path / "truncated.bin", data[:-100])
    with pytest.raises(ValueError, match=r"truncated\.bin.*1056540 bytes but the file has 1056440 bytes \(truncated\)"):
        load_llama2c_model(truncated)
    extra = _write(tmp_path / "extra.bin", data + b"\0" * 8)
    with pytest.raises(ValueError, match=r"1056540 bytes but the file has 1056548 bytes \(trailing data\)"):
        load_llama2c_model(extra)
    tiny = _write(tmp_path / "tiny.bin", data[:10])
    with pytest.raises(ValueError, match="10 bytes, shorter than the 28-byte llama2.c header"):
        load_llama2c_model(tiny)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((64, 172, 0, 8, 4, 512, 512), "n_layers=0 must be positive"),
        ((-64, 172, 5, 8, 4, 512, 512), "dim=-64 must be positive"),
        ((64, 172, 5, 8, 4, 0, 512), r"\|vocab_size\|=0 must be positive"),
        ((63, 172, 5, 8, 4, 512, 512), "dim=63 is not divisible by n_heads=8"),
        ((64, 172, 5, 8, 3, 512, 512), "n_heads=8 is not divisible by n_kv_heads=3"),
        ((48, 172, 5, 16, 4, 512, 512), "head_dim=3 .* must be even"),
    ],
)
def test_nonsensical_header(
    stories_dir: Path, tmp_path: Path, values: tuple[int, ...], message: str
) -> None:
    data = (stories_dir / "stories260K.bin").read_bytes()
    bad = _write(tmp_path / "bad.bin", struct.pack("<7i", *values) + data[28:])
    with pytest.raises(ValueError, match=rf"bad\.bin: nonsensical llama2.c header \(.*{message}"):
        load_llama2c_model(bad)


def test_truncated_or_corrupt_tokenizer(stories_dir: Path, tmp_path: Path) -> None:
    data = (stories_dir / "tok512.bin").read_bytes()
    cut = _write(tmp_path / "cut.bin", data[:-3])
    with pytest.raises(ValueError, match=r"cut\.bin: truncated llama2.c tokenizer, token 511 needs"):
        load_llama2c_tokenizer(cut)
    # cut on a record boundary after 100 tokens: still detected, the byte pieces are incomplete
    boundary = 4 + sum(8 + len(p) for p in _read_pieces(stories_dir / "tok512.bin")[0][:100])
    short = _write(tmp_path / "short.bin", data[:boundary])
    with pytest.raises(ValueError, match=r"short\.bin: 100 tokens, .* the file is truncated"):
        load_llama2c_tokenizer(short)
    with pytest.raises(ValueError, match="too short"):
        load_llama2c_tokenizer(_write(tmp_path / "empty.bin", b""))
    # token 0's byte length (at offset 8) set to 1000: larger than the max token length 7
    corrupt = bytearray(data)
    corrupt[8:12] = struct.pack("<i", 1000)
    with pytest.raises(ValueError, match=r"corrupt llama2.c tokenizer, token 0 .* byte length 1000 outside 1\.\.7"):
        load_llama2c_tokenizer(_write(tmp_path / "corrupt.bin", bytes(corrupt)))
    # the piece of id 3 (<0x00>) overwritten: not a byte-fallback vocabulary
    swapped = data.replace(b"<0x00>", b"<0xZZ>", 1)
    with pytest.raises(ValueError, match=r"token 3 is b'<0xZZ>', expected the byte piece"):
        load_llama2c_tokenizer(_write(tmp_path / "swapped.bin", swapped))
