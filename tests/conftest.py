"""Shared test fixtures: tiny random causal LMs of each supported family, built from a config (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 97
HIDDEN = 32

# The CPU kinds this project's machines come in, by the flags that decide dtype=auto (medusa_train.config.precision).
AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
CPU_KINDS = {"avx2": AVX2_ONLY, "avx512_bf16": ZEN4, "amx": SAPPHIRE_RAPIDS}


def pytest_addoption(parser):
    parser.addoption("--cpu", choices=("native", *CPU_KINDS), default="native",
                     help="run the suite as this kind of CPU: its flags replace the machine's (MEDUSA_CPU_FLAGS, "
                          "subprocesses included), so dtype=auto resolves as there; the kernels stay this machine's")


def pytest_configure(config):
    from medusa_train.config.precision import CPU_FLAGS_ENV

    kind = config.getoption("--cpu")
    if kind != "native":
        os.environ[CPU_FLAGS_ENV] = ",".join(sorted(CPU_KINDS[kind]))


def pytest_report_header(config):
    from medusa_train.config.precision import CPU_FLAGS_ENV, choose_dtype, cpu_isa

    faked = f" (faked: --cpu={config.getoption('--cpu')})" if CPU_FLAGS_ENV in os.environ else ""
    return (f"cpu flags{faked}: {', '.join(cpu_isa()['flags']) or 'none of note'}; "
            f"dtype=auto -> {choose_dtype('auto', 'cpu').name} on the CPU")

# family -> (config class, kwargs): two layers, small hidden size, an odd vocabulary so shape bugs show.
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)),
    "gemma": (transformers.GemmaConfig, dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "gpt2": (transformers.GPT2Config, dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=256)),
    "gpt_neox": (transformers.GPTNeoXConfig, dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=256)),
}


def make_tiny_model(family: str = "llama", seed: int = 0, vocab_size: int = VOCAB, **overrides) -> torch.nn.Module:
    """A tiny random ``*ForCausalLM`` of ``family`` in fp32 eval mode, deterministic for a seed."""
    config_cls, kwargs = FAMILIES[family]
    config = config_cls(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, int]:
    """Pearson's chi-square goodness of fit of ``observed`` counts against ``expected`` ones (same shape, any):
    cells expected below 5 are pooled into one. Returns ``(p_value, chi2, degrees of freedom)``."""
    expected, observed = expected.flatten().double(), observed.flatten().double()
    big = expected >= 5
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    observed = torch.cat([observed[big], observed[~big].sum().view(1)])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = expected.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2)))
    return p_value, chi2, dof


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` run only where vLLM's environment is installed; elsewhere they skip and say how to get it."""
    from medusa_train.engines.vllm_env import VllmUnavailable, vllm_python

    try:
        vllm_python()
        return
    except VllmUnavailable as e:
        skip = pytest.mark.skip(reason=str(e))
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


def _onednn_packs_bf16() -> bool:
    from medusa_train.loading.cpu_kernels import onednn_available, onednn_packs

    return onednn_available() and onednn_packs(torch.bfloat16)


# Skip where oneDNN cannot pack bf16 weights on this CPU (AVX2-only: no AVX-512 BW/VL/DQ); BF16 is the dtype
# parameter that carries it.
NEEDS_BF16_PACKING = pytest.mark.skipif(not _onednn_packs_bf16(), reason="oneDNN cannot pack bf16 weights on this "
                                        "CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
BF16 = pytest.param(torch.bfloat16, marks=NEEDS_BF16_PACKING, id="bfloat16")


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny models run faster on one, and much faster when other processes share the
    CPU (OpenMP threads oversubscribe it). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return make_tiny_model("llama")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
    """A character-level tokenizer with ``vocab_size`` ids and a ChatML chat template, built offline.

    Ids 0-4 are <pad>, <s>, <|im_end|>, <|im_start|>, <unk>; the rest are printable characters.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]  # the last few printable characters fall off at V=97
    vocab = {tok: i for i, tok in enumerate((specials + chars)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast
