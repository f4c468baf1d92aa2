"""A fake vLLM engine for the repeat drafter: what :class:`medusa_train.engines.vllm_env.VllmWorker` is to the real
one (the same constructor and ``generate`` reply), in this process. It loads the target from the path the engine
decoder gives it, refuses a ``speculative_config`` that is not the repeat drafter's (method, folder, engine files
and draft length), and answers greedily with the target, as a lossless engine would."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from medusa_train.export.files import read_json
from tests.toy_drafter.serving import CONFIG_FILE, VLLM_METHOD

STARTED: list["FakeVllmWorker"] = []  # every engine started, for the test to look at


class FakeVllmWorker:
    """Stands in for ``VllmWorker(model, dtype=..., speculative_config=..., ...)``.

    Raises:
        ValueError: a speculative config of another method, without its engine files, or drafting fewer than 1 or
            more tokens than the drafter has heads.
    """

    vllm_version = "fake"

    def __init__(self, model: str, dtype: str = "auto", speculative_config: dict[str, Any] | None = None,
                 **settings: Any) -> None:
        if speculative_config is not None:
            if speculative_config.get("method") != VLLM_METHOD:
                raise ValueError(f"the fake engine serves method {VLLM_METHOD!r}, got {speculative_config}")
            drafter = read_json(Path(speculative_config["model"]) / CONFIG_FILE)
            if not 1 <= speculative_config["num_speculative_tokens"] <= drafter["num_heads"]:
                raise ValueError(f"num_speculative_tokens must be in [1, {drafter['num_heads']}]")
        self.model, self.speculative_config, self.settings = model, speculative_config, settings
        self.target = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.info = {"start_s": 0.0}
        self.log_path = Path(model) / "fake-engine.log"
        self.closed = False
        STARTED.append(self)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int, eos_token_ids: Any = (), **sampling: Any
                 ) -> dict[str, Any]:
        """Greedy replies: ``{"outputs": [{"token_ids", "finish_reason", "first_token_s"}], "wall_s", "spec"}``."""
        start, outputs = time.perf_counter(), []
        for prompt in prompts:
            ids, reply, reason = torch.tensor([prompt]), [], "length"
            for _ in range(max_tokens):
                token = int(self.target(ids).logits[0, -1].argmax())
                reply.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
                if token in eos_token_ids:
                    reason = "stop"
                    break
            outputs.append({"token_ids": reply, "finish_reason": reason, "first_token_s": 0.0})
        spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
        return {"outputs": outputs, "wall_s": time.perf_counter() - start, "spec": spec}

    def close(self) -> None:
        self.closed = True


__all__ = ["STARTED", "FakeVllmWorker"]
