"""Pad tokenized conversations into a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.models.generation import pad_token_id_of


@dataclass
class Collator:
    """Right-pad ``{"input_ids": [T_i], "labels": [T_i]}`` features into a batch.

    Attributes:
        pad_token_id: id written into padded input positions (use :meth:`from_tokenizer`).
        pad_to_multiple_of: round the batch length T up to a multiple of this (None: the longest example).

    Calling it on a list of B features returns ``input_ids`` [B, T] int64 (padded with ``pad_token_id``),
    ``labels`` [B, T] int64 (padded with -100) and ``attention_mask`` [B, T] int64 (1 on real tokens).
    Other keys of the features are ignored.

    Raises:
        ValueError: an empty batch, a feature whose ``input_ids`` and ``labels`` differ in length, or
            ``pad_to_multiple_of`` not positive.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            raise ValueError(f"pad_to_multiple_of must be positive or None, got {self.pad_to_multiple_of}")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, pad_to_multiple_of: int | None = None) -> Collator:
        """A collator padding with the tokenizer's pad id (EOS when it has none)."""
        return cls(pad_token_id=pad_token_id_of(tokenizer), pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        lengths = [len(f["input_ids"]) for f in features]
        for i, f in enumerate(features):
            if len(f["labels"]) != lengths[i]:
                raise ValueError(
                    f"feature {i}: input_ids has {lengths[i]} tokens but labels has {len(f['labels'])}"
                )
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, (f, n) in enumerate(zip(features, lengths)):
            input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(f["labels"], dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
