"""vLLM's Medusa loading rules, re-implemented for CPU tests (no vLLM install needed).

Shared by tests that check an export's ``vllm/`` folder loads as vLLM would load it and gives the same head logits:
``tests/medusa_train/test_export.py`` and ``tests/medusa_train/test_publish.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

VLLM_VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE in vllm/model_executor/layers/vocab_parallel_embedding.py


def vllm_medusa_config(folder: Path) -> SimpleNamespace:
    """vLLM's ``MedusaConfig.from_pretrained`` (vllm/transformers_utils/configs/medusa.py at 0531c22)."""
    d = json.loads((folder / "config.json").read_text())
    for k in list(d):
        if "num" in k:
            if "heads" in k:
                d["num_heads"] = d.pop(k)
            elif "layers" in k:
                d["num_hidden_layers"] = d.pop(k)
    cfg = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1, "max_paths": 64,
           "topk": 10, "truncated_vocab_size": None, "architectures": ["MedusaModel"], **d}
    if cfg["truncated_vocab_size"] is None:
        cfg["truncated_vocab_size"] = cfg["vocab_size"]
    return SimpleNamespace(**cfg)


class VllmMedusaReference:
    """vLLM's ``Medusa`` (vllm/model_executor/models/medusa.py at 09cddad) on one device, without tensor parallelism.

    Parameters as vLLM registers them (``blocks.{h}.layers.{l}.weight|bias``; ``lm_heads.{h}.weight``, or one
    ``lm_head.weight`` with ``original_lm_head``), rows of a projection padded to a multiple of 64.
    """

    def __init__(self, config: SimpleNamespace) -> None:
        # vLLM picks MedusaConfig by model_type and the Medusa class by architecture.
        assert config.model_type == "medusa" and "MedusaModel" in config.architectures
        self.config = config
        dtype = getattr(torch, getattr(config, "torch_dtype", "float32"))
        H, K, L = config.hidden_size, config.num_heads, config.num_hidden_layers
        self.orig_vocab_size = config.vocab_size
        self.truncated_vocab_size = config.truncated_vocab_size
        padded = -(-self.truncated_vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        self.params: dict[str, torch.Tensor] = {}
        for h in range(K):
            for l in range(L):
                self.params[f"blocks.{h}.layers.{l}.weight"] = torch.empty(H, H, dtype=dtype)
                if getattr(config, "medusa_fc_bias", False):
                    self.params[f"blocks.{h}.layers.{l}.bias"] = torch.empty(H, dtype=dtype)
        if getattr(config, "original_lm_head", False):
            self.params["lm_head.weight"] = torch.empty(padded, H, dtype=dtype)
            self.lm_heads = ["lm_head.weight"] * K
        else:
            self.lm_heads = [f"lm_heads.{h}.weight" for h in range(K)]
            for name in self.lm_heads:
                self.params[name] = torch.empty(padded, H, dtype=dtype)
        self.token_map: torch.Tensor | None = None

    def load_weights(self, weights) -> tuple[set[str], list[str]]:
        """``Medusa.load_weights``; returns (loaded parameter names, checkpoint names vLLM silently ignores)."""
        loaded, ignored, weights_map = set(), [], {}
        for name, tensor in weights:
            name = name.replace("medusa_heads.", "")
            if name == "token_map":
                if self.truncated_vocab_size < self.orig_vocab_size:
                    self.token_map = tensor
                else:
                    ignored.append(name)
            elif name in self.params:
                weights_map[name] = tensor
            elif getattr(self.config, "original_lm_head", False) and name == "lm_heads.0.weight":
                weights_map["lm_head.weight"] = tensor
            else:
                ignored.append(name)
        for name, tensor in weights_map.items():
            if "lm_head" in name and self.token_map is not None and tensor.shape[0] > self.token_map.shape[0]:
                tensor = tensor[self.token_map]
            param = self.params[name]
            if "lm_head" in name:  # VocabParallelEmbedding.weight_loader
                assert tensor.shape[0] == self.truncated_vocab_size
                param[: tensor.shape[0]].copy_(tensor)
                param[tensor.shape[0]:].fill_(0)
            else:  # default_weight_loader
                assert param.size() == tensor.size()
                param.copy_(tensor)
            loaded.add(name)
        assert self.truncated_vocab_size == self.orig_vocab_size or self.token_map is not None
        return loaded, ignored

    def compute_logits(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """``forward`` + ``compute_logits``: per head ``[..., V]`` logits, ``-inf`` off the token map."""
        out = []
        for h, lm_head in enumerate(self.lm_heads):
            x = hidden
            for l in range(self.config.num_hidden_layers):
                x = x + F.silu(F.linear(x, self.params[f"blocks.{h}.layers.{l}.weight"],
                                        self.params.get(f"blocks.{h}.layers.{l}.bias")))
            logits = F.linear(x, self.params[lm_head])[..., : self.truncated_vocab_size]  # LogitsProcessor
            if self.token_map is not None:
                full = torch.full((*logits.shape[:-1], self.orig_vocab_size), -torch.inf, dtype=logits.dtype)
                full[..., self.token_map] = logits
                logits = full
            out.append(logits)
        return out


def vllm_load(folder: Path) -> tuple[VllmMedusaReference, list[str]]:
    """DefaultModelLoader: every ``*.safetensors`` file, then the strict "not initialized" check."""
    model = VllmMedusaReference(vllm_medusa_config(folder))
    weights = [(k, v) for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()]
    loaded, ignored = model.load_weights(weights)
    not_loaded = set(model.params) - loaded
    if not_loaded:
        raise ValueError(f"Following weights were not initialized from checkpoint: {not_loaded}")
    return model, ignored
