"""Convert a llama2.c checkpoint and its ``tokenizer.bin`` into a transformers Llama and a fast tokenizer.

llama2.c (karpathy/llama2.c, ``export.py:legacy_export`` and ``run.c``) stores a model as a header of 7 little-endian
int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len; a negative vocab_size means the
classifier is stored separately) followed by float32 arrays, each a torch ``nn.Linear`` weight in (out, in) row-major
order. Its tokenizer file is an int32 max token length, then per token a float32 score, an int32 byte length and
the UTF-8 bytes; ids 0, 1, 2 are unk, BOS, EOS and ids 3..258 the byte-fallback pieces ``<0x00>``..``<0xFF>``.

llama2.c's RoPE rotates interleaved pairs (2i, 2i+1) of each head, transformers' Llama rotates the halves (i, i + D/2),
so the rows of wq and wk are permuted per head on conversion (the same permutation transformers'
``convert_llama_weights_to_hf.py`` applies to Meta's checkpoints). Reference check: greedy decoding of stories260K
from BOS alone gives "Once upon a time, there was a little girl named Lily. ..." (see the tests).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HEADER_FORMAT = "<7i"
HEADER_BYTES = struct.calcsize(HEADER_FORMAT)  # 28
FLOAT_BYTES = 4
SPACE_MARK = "▁"  # U+2581, sentencepiece's whitespace marker
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
N_BYTE_PIECES = 256  # ids 3..258
FIRST_NORMAL_ID = len(SPECIAL_PIECES) + N_BYTE_PIECES  # 259

# The model is not a chat model: the template only concatenates the turns so that chat-template code paths (prompt
# rendering, assistant-token masks through {% generation %}) run on it. BOS, then each message's content, turns
# separated by a newline, EOS after each assistant turn; add_generation_prompt appends the separator, so a rendered
# prompt is always a prefix of the rendered conversation. Every role's content is kept (system, user, assistant).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt and messages %}{{ '\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7-int32 header of a llama2.c checkpoint, validated.

    ``vocab_size`` is always positive here; ``shared_classifier`` records the sign it had in the file.
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    shared_classifier: bool
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def array_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the float32 arrays in file order, (out, in) for linear weights; L layers, V vocab, H dim."""
        L, H, F, V, S = self.n_layers, self.dim, self.hidden_dim, self.vocab_size, self.max_seq_len
        shapes: dict[str, tuple[int, ...]] = {
            "token_embedding": (V, H),
            "rms_att": (L, H),
            "wq": (L, H, H),
            "wk": (L, self.kv_dim, H),
            "wv": (L, self.kv_dim, H),
            "wo": (L, H, H),
            "rms_ffn": (L, H),
            "w1": (L, F, H),
            "w2": (L, H, F),
            "w3": (L, F, H),
            "rms_final": (H,),
            "freq_cis_real": (S, self.head_dim // 2),
            "freq_cis_imag": (S, self.head_dim // 2),
        }
        if not self.shared_classifier:
            shapes["wcls"] = (V, H)
        return shapes

    def expected_file_bytes(self) -> int:
        """Size in bytes of a checkpoint with this header: the header plus every float32 array."""
        return HEADER_BYTES + FLOAT_BYTES * sum(math.prod(s) for s in self.array_shapes().values())


def _require_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c {what} {path} not found (or not a regular file)")
    return path


def read_llama2c_header(path: str | Path) -> Llama2cHeader:
    """Read and validate a llama2.c checkpoint's header, and check the file size it implies.

    Reads only the 28-byte header, so every check runs before any weight is read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is shorter than the header; a header value is nonsensical (non-positive sizes, dim not
            divisible by n_heads, n_heads not divisible by n_kv_heads, odd head_dim); or the file size differs
            from the size the header implies (the message gives expected and actual bytes).
    """
    path = _require_file(path, "checkpoint")
    actual = path.stat().st_size
    if actual < HEADER_BYTES:
        raise ValueError(
            f"{path}: {actual} bytes, shorter than the {HEADER_BYTES}-byte llama2.c header; not a llama2.c checkpoint"
        )
    with path.open("rb") as f:
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len = struct.unpack(
            HEADER_FORMAT, f.read(HEADER_BYTES)
        )
    fields = {
        "dim": dim,
        "hidden_dim": hidden_dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "|vocab_size|": abs(vocab_size),
        "max_seq_len": max_seq_len,
    }
    problems = [f"{name}={value} must be positive" for name, value in fields.items() if value <= 0]
    if not problems:
        if dim % n_heads:
            problems.append(f"dim={dim} is not divisible by n_heads={n_heads}")
        elif (dim // n_heads) % 2:
            problems.append(f"head_dim={dim // n_heads} (dim/n_heads) must be even for RoPE")
        if n_heads % n_kv_heads:
            problems.append(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
    if problems:
        raise ValueError(
            f"{path}: nonsensical llama2.c header ({'; '.join(problems)}); the file is corrupt or not a legacy "
            "llama2.c checkpoint (version-2 files from export.py --version 2 start with the magic 'ak42' instead)"
        )
    header = Llama2cHeader(
        dim=dim,
        hidden_dim=hidden_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=abs(vocab_size),
        shared_classifier=vocab_size > 0,
        max_seq_len=max_seq_len,
    )
    expected = header.expected_file_bytes()
    if actual != expected:
        raise ValueError(
            f"{path}: size mismatch, the header {header} implies {expected} bytes but the file has {actual} bytes "
            f"({'truncated' if actual < expected else 'trailing data'}); re-export or re-download the checkpoint"
        )
    return header


def read_llama2c_weights(path: str | Path) -> tuple[Llama2cHeader, dict[str, np.ndarray]]:
    """The header and the raw float32 arrays of a llama2.c checkpoint, in llama2.c's own layout (no permutation).

    Returns:
        ``(header, arrays)`` with ``arrays`` keyed and shaped as :meth:`Llama2cHeader.array_shapes` (float32).

    Raises:
        FileNotFoundError, ValueError: as :func:`read_llama2c_header`, before any weight is read.
    """
    header = read_llama2c_header(path)
    flat = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES)
    arrays: dict[str, np.ndarray] = {}
    start = 0
    for name, shape in header.array_shapes().items():
        size = math.prod(shape)
        arrays[name] = flat[start : start + size].reshape(shape)
        start += size
    return header, arrays


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from llama2.c's interleaved RoPE pairs to HF's rotate-half.

    Within each head, rows (0, 1, 2, 3, ..., D-2, D-1) become (0, 2, ..., D-2, 1, 3, ..., D-1), D the head dim.
    ``w``: (n_heads * D, H) -> same shape.
    """
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def llama2c_config(header: Llama2cHeader) -> LlamaConfig:
    """The transformers ``LlamaConfig`` equivalent to a llama2.c header (RMSNorm eps 1e-5, RoPE theta 10000)."""
    return LlamaConfig(
        vocab_size=header.vocab_size,
        hidden_size=header.dim,
        intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers,
        num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads,
        head_dim=header.head_dim,
        max_position_embeddings=header.max_seq_len,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=header.shared_classifier,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


def load_llama2c_model(checkpoint: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a legacy llama2.c checkpoint as a transformers ``LlamaForCausalLM`` in eval mode.

    Weights map as llama2.c -> HF: token_embedding -> embed_tokens, rms_att/rms_ffn -> input/post_attention
    layernorm, wq/wk (rows permuted, see module doc)/wv/wo -> q/k/v/o_proj, w1/w3/w2 -> gate/up/down_proj,
    rms_final -> norm, wcls (or the embedding when shared) -> lm_head. The stored RoPE tables are ignored; HF
    recomputes them with theta 10000.

    Args:
        checkpoint: the ``.bin`` file written by llama2.c's ``export.py --version 0`` (legacy format).
        dtype: floating dtype of the returned parameters (the file holds float32).

    Returns:
        The model on CPU, ``config.max_position_embeddings`` = the checkpoint's max_seq_len, BOS 1, EOS 2,
        ``tie_word_embeddings`` = whether the classifier is shared.

    Raises:
        FileNotFoundError: the checkpoint does not exist.
        ValueError: ``dtype`` is not floating point; the header is nonsensical or the size does not match it
            (both checked before any weight is read).
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype such as torch.float32 or torch.bfloat16")
    header, raw = read_llama2c_weights(checkpoint)
    t = {name: torch.from_numpy(array) for name, array in raw.items()}
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t["token_embedding"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = t["rms_att"][i]
        state[p + "self_attn.q_proj.weight"] = _interleaved_to_halves(t["wq"][i], header.n_heads)
        state[p + "self_attn.k_proj.weight"] = _interleaved_to_halves(t["wk"][i], header.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = t["wv"][i]
        state[p + "self_attn.o_proj.weight"] = t["wo"][i]
        state[p + "post_attention_layernorm.weight"] = t["rms_ffn"][i]
        state[p + "mlp.gate_proj.weight"] = t["w1"][i]
        state[p + "mlp.down_proj.weight"] = t["w2"][i]
        state[p + "mlp.up_proj.weight"] = t["w3"][i]
    state["model.norm.weight"] = t["rms_final"]
    state["lm_head.weight"] = t["token_embedding"] if header.shared_classifier else t["wcls"]

    model = LlamaForCausalLM(llama2c_config(header))
    # strict: every parameter of the HF model gets a value and nothing is left over
    model.load_state_dict(state, strict=True)
    if header.shared_classifier and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        model.tie_weights()
    model.config.name_or_path = str(checkpoint)
    return model.to(dtype).eval()


def _read_tokenizer_pieces(path: Path) -> tuple[list[bytes], list[float]]:
    """The raw pieces and scores of a llama2.c ``tokenizer.bin``; ``ValueError`` on a truncated or corrupt file."""
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a llama2.c tokenizer (truncated or empty)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if max_len <= 0:
        raise ValueError(f"{path}: corrupt llama2.c tokenizer, max token length {max_len} must be positive")
    pieces: list[bytes] = []
    scores: list[float] = []
    offset = 4
    while offset < len(data):
        token_id = len(pieces)
        if offset + 8 > len(data):
            raise ValueError(
                f"{path}: truncated llama2.c tokenizer, token {token_id} header needs 8 bytes at offset {offset} "
                f"but the file ends at {len(data)}"
            )
        score, length = struct.unpack_from("<fi", data, offset)
        if not 0 < length <= max_len:
            raise ValueError(
                f"{path}: corrupt llama2.c tokenizer, token {token_id} at offset {offset} has byte length {length} "
                f"outside 1..{max_len} (the file's max token length)"
            )
        if not math.isfinite(score):
            raise ValueError(f"{path}: corrupt llama2.c tokenizer, token {token_id} has score {score}")
        offset += 8
        if offset + length > len(data):
            raise ValueError(
                f"{path}: truncated llama2.c tokenizer, token {token_id} needs {length} bytes at offset {offset} "
                f"but the file ends at {len(data)}"
            )
        pieces.append(data[offset : offset + length])
        scores.append(score)
        offset += length
    return pieces, scores


def _hf_vocab(path: Path, pieces: list[bytes]) -> list[str]:
    """HF piece strings by id: fixed names for ids 0..2, byte pieces as stored, '▁' for spaces elsewhere."""
    if len(pieces) <= FIRST_NORMAL_ID:
        raise ValueError(
            f"{path}: {len(pieces)} tokens, a llama2.c sentencepiece tokenizer has more than {FIRST_NORMAL_ID} "
            "(unk, BOS, EOS and 256 byte pieces first); the file is truncated"
        )
    for b in range(N_BYTE_PIECES):
        expected = f"<0x{b:02X}>".encode()
        if pieces[len(SPECIAL_PIECES) + b] != expected:
            raise ValueError(
                f"{path}: token {len(SPECIAL_PIECES) + b} is {pieces[len(SPECIAL_PIECES) + b]!r}, expected the byte "
                f"piece {expected!r}; only sentencepiece byte-fallback vocabularies (ids 3..258) are supported"
            )
    vocab = list(SPECIAL_PIECES) + [p.decode("ascii") for p in pieces[len(SPECIAL_PIECES) : FIRST_NORMAL_ID]]
    for token_id in range(FIRST_NORMAL_ID, len(pieces)):
        try:
            text = pieces[token_id].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: corrupt llama2.c tokenizer, token {token_id} is not valid UTF-8") from e
        vocab.append(text.replace(" ", SPACE_MARK))
    seen: dict[str, int] = {}
    for token_id, piece in enumerate(vocab):
        if piece in seen:
            raise ValueError(
                f"{path}: corrupt llama2.c tokenizer, tokens {seen[piece]} and {token_id} are both {piece!r}"
            )
        seen[piece] = token_id
    return vocab


def _merges_by_score(vocab: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that replay llama2.c's greedy encode (``run.c:encode``).

    llama2.c repeatedly merges the adjacent pair whose concatenation is the vocabulary piece with the highest score
    (leftmost on ties). Every split ``a + b`` of a piece ``t`` with both halves in the vocabulary becomes a merge
    ranked by ``t``'s score (descending, then id): HF's BPE applies the lowest-ranked pair first, leftmost on ties,
    which is the same order. Special and byte pieces neither merge nor result from a merge. The one possible
    divergence: two different splits of the same piece overlapping in the text (``x+y == y+z == t``), where
    llama2.c takes the leftmost and HF the lower-ranked split; it does not arise on the texts in the tests.
    """
    normal = set(vocab[FIRST_NORMAL_ID:])
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id in range(FIRST_NORMAL_ID, len(vocab)):
        piece = vocab[token_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def load_llama2c_tokenizer(tokenizer_bin: str | Path) -> PreTrainedTokenizerFast:
    """Build a fast tokenizer that encodes exactly like llama2.c's ``encode`` (and sentencepiece BPE) on its vocab.

    Encoding: a '▁' dummy prefix is prepended to non-empty text and spaces become '▁' (sentencepiece
    ``add_dummy_prefix``; done with a ``Prepend`` normalizer rather than a ``Metaspace`` pre-tokenizer because
    Metaspace skips the prefix when the text already starts with a space, which llama2.c does not); the whole text
    is one BPE word; merges are ordered by piece score (:func:`_merges_by_score`); characters outside the vocabulary
    fall back to their UTF-8 bytes ``<0xNN>``. BOS is added by default (like Llama), EOS is not.
    Decoding inverts it exactly: '▁' -> space, byte pieces fused back into UTF-8, the dummy prefix stripped.

    The chat template (:data:`CHAT_TEMPLATE`) is a stand-in, since llama2.c models are not chat models: BOS, the
    messages' contents separated by newlines, EOS after each assistant turn (inside ``{% generation %}`` so
    ``return_assistant_tokens_mask`` works).

    Args:
        tokenizer_bin: llama2.c's tokenizer file (``tokenizer.bin``, ``tok512.bin``...).

    Returns:
        A ``PreTrainedTokenizerFast`` with unk ``<unk>`` (0), BOS ``<s>`` (1), EOS ``</s>`` (2), no pad token,
        ``clean_up_tokenization_spaces=False``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is truncated or corrupt (bad lengths, non-UTF-8 piece, duplicate pieces, fewer than
            259 tokens, ids 3..258 not the byte pieces).
    """
    path = _require_file(tokenizer_bin, "tokenizer")
    pieces, scores = _read_tokenizer_pieces(path)
    vocab = _hf_vocab(path, pieces)
    bpe = models.BPE(
        vocab={piece: token_id for token_id, piece in enumerate(vocab)},
        merges=_merges_by_score(vocab, scores),
        unk_token=SPECIAL_PIECES[0],
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", SPACE_MARK)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in SPECIAL_PIECES])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIAL_PIECES[0],
        bos_token=SPECIAL_PIECES[1],
        eos_token=SPECIAL_PIECES[2],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
