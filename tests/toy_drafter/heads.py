"""The repeat drafter's module: every head guesses the target's own next token again, its logits scaled by the
drafter's own option ``heads.scale`` (:mod:`tests.toy_drafter.options`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.models.catalog import TargetInputs
from medusa_train.models.features import FINAL
from medusa_train.models.heads_base import HeadsSpec, register_token_map


@dataclass(frozen=True)
class RepeatSpec(HeadsSpec):
    """Shape of the repeat drafter: HeadsSpec's fields and its own option.

    Attributes:
        scale: every head's logits are multiplied by it (``heads.scale``, > 0): the greedy draft is the same for any
            scale, the loss is not.
    """

    scale: float = 1.0


class RepeatHeads(nn.Module):
    """Every head guesses the target's own next token again: ``scale * hidden [..., H] @ proj [V', H]^T + bias[k]``,
    the projection copied from the target's lm_head. A drafter nobody would ship, and the smallest that trains."""

    def __init__(self, spec: RepeatSpec, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.proj = nn.Parameter(torch.zeros(spec.out_size, spec.hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_heads, spec.out_size))
        register_token_map(self, spec, token_map)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.dtype

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> None:
        self.proj.copy_(weight if self.token_map is None else weight[self.token_map])

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        k = num_heads or self.spec.num_heads
        logits = self.spec.scale * (hidden.to(self.dtype) @ self.proj.T)  # [..., V']
        return logits[None] + self.bias[:k].reshape(k, *([1] * (logits.dim() - 1)), -1)  # [K', ..., V']

    def to_base_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]


def repeat_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None) -> torch.Tensor:
    """Its loss logits: every head reads the final hidden state, ``[K', ..., V']``."""
    return heads(inputs.features[FINAL], num_heads)
