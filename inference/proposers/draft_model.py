"""A draft model as a :class:`~inference.proposers.base.Proposer`: K autoregressive draft steps per target pass
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Sec. 2.3; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2).

The draft keeps its own KV cache for the request. Before drafting it keeps the longest prefix of what it has read
that the committed sequence still agrees with (rejected drafts are cropped away) and reads the rest, so the first
proposal is also the draft's prefill. Greedy requests draft by argmax (point-mass drafts); sampled requests draw each
token from the draft's warped distribution q (same temperature / top-k / top-p as the target) and return q, as
lossless speculative sampling requires.

K is fixed (``schedule="constant"``) or adapted by the heuristic of Hugging Face's assisted generation
(transformers 5.24 ``AssistedCandidateGenerator.update_candidate_strategy``): K + 2 after a pass that accepted every
drafted token, max(1, K - 1) otherwise; it starts from ``num_draft_tokens`` for every request. With
``confidence_threshold`` > 0 the draft also stops early, after a token to which it gave less probability than the
threshold (transformers' ``assistant_confidence_threshold``, ``ConfidenceCriteria``; fixed here, not tuned online).
Stopping on the draft's own tokens keeps speculative sampling lossless: each drafted token is still verified against
the distribution it was drawn from, and the token after the last accepted one is drawn from the target.

Shapes: T sequence, K drafted tokens, V vocabulary.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from inference.decode_config import DecodeConfig
from inference.draft_loading import check_draft_length, check_schedule
from inference.proposers.base import Proposal, empty_proposal
from medusa_train.tree.kv_cache import crop
from medusa_train.tree.sampling import logits_to_probs


@lru_cache(maxsize=None)
def takes_logits_to_keep(model_class: type) -> bool:
    """True when ``model_class.forward`` takes ``logits_to_keep`` (the lm_head then runs on chosen positions)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def last_logits(model: PreTrainedModel, input_ids: Tensor, cache: DynamicCache) -> Tensor:
    """Read ``input_ids`` (long ``[1, T]``) after ``cache`` (extended in place); the logits after the last token,
    float ``[V]`` (the lm_head runs on that position only when the model takes ``logits_to_keep``)."""
    kwargs: dict[str, Any] = {"cache": cache, "use_cache": True}
    if takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = 1
    return model(input_ids=input_ids, **kwargs).logits[0, -1]


def check_confidence_threshold(value: float) -> float:
    """Return ``value`` if it is a number in [0, 1), else raise ``ValueError`` naming ``confidence_threshold``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"confidence_threshold must be in [0, 1) (0 = always draft K tokens), got {value!r}")
    return float(value)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    """Drafts K tokens with a small model sharing the target's vocabulary (one request).

    Args:
        draft: a ``*ForCausalLM`` whose logits cover the target's V ids (see
            :func:`inference.draft_loading.check_draft_compatible`).
        config: the request (greedy or sampled drafting, warping).
        generator: sampling generator on the draft's device (None when greedy).
        num_draft_tokens: K (the first K when adaptive), >= 1.
        schedule: ``constant`` or ``heuristic`` (see the module docstring).
        confidence_threshold: in [0, 1); stop drafting after a token whose draft probability is below it (0: off).

    Raises:
        ValueError: K < 1, an unknown schedule or a threshold outside [0, 1) (the message names the field).
    """

    def __init__(
        self,
        draft: PreTrainedModel,
        config: DecodeConfig,
        generator: torch.Generator | None,
        num_draft_tokens: int,
        schedule: str = "constant",
        confidence_threshold: float = 0.0,
    ) -> None:
        self.k = check_draft_length(num_draft_tokens)
        check_schedule(schedule)
        self.threshold = check_confidence_threshold(confidence_threshold)
        self.draft = draft
        self.config = config
        self.generator = generator
        self.schedule = schedule
        self.device = draft.get_output_embeddings().weight.device
        self.cache = DynamicCache(config=draft.config)
        self.read: list[int] = []  # the tokens whose KV entries self.cache holds, in order
        self.proposed = 0  # K of the last proposal

    def _next_logits(self, tokens: Sequence[int]) -> Tensor:
        """Read ``tokens`` after the cache; the draft's logits for the token after them, float ``[V]``."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        logits = last_logits(self.draft, ids, self.cache)
        self.read.extend(tokens)
        return logits

    @torch.no_grad()
    def propose(self, sequence: Sequence[int], max_tokens: int) -> Proposal:
        """Up to K = min(current K, ``max_tokens``) drafted tokens continuing ``sequence`` (fewer when the draft's
        confidence drops below the threshold): ``tokens [1, K']``, ``probs [1, K', V]`` when sampling, else None;
        the empty proposal when ``max_tokens`` is 0."""
        k = min(self.k, max_tokens)
        self.proposed = max(k, 0)
        if k <= 0:
            return empty_proposal(self.device)
        keep = min(_common_prefix(self.read, sequence), len(sequence) - 1)
        crop(self.cache, keep)
        del self.read[keep:]
        feed: Sequence[int] = sequence[keep:]
        tokens: list[int] = []
        probs: list[Tensor] = []
        for _ in range(k):
            logits = self._next_logits(feed)
            if self.config.greedy:
                token = int(logits.argmax())
                confident = self.threshold == 0 or float(torch.softmax(logits.float(), -1)[token]) >= self.threshold
            else:
                q = logits_to_probs(logits, self.config.temperature, self.config.top_k, self.config.top_p)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                probs.append(q)
                confident = float(q[token]) >= self.threshold
            tokens.append(token)
            feed = [token]
            if not confident:
                break
        self.proposed = len(tokens)
        # The last drafted token is not read: if every draft is accepted it is re-read from the sequence next time.
        return Proposal(
            tokens=torch.tensor([tokens], dtype=torch.long, device=self.device),
            probs=torch.stack(probs).unsqueeze(0) if probs else None,
        )

    def update(self, sequence: Sequence[int], accepted: int, aux_logits: Tensor | None = None) -> None:
        """Adapt K (``heuristic`` schedule): +2 when all ``proposed`` tokens were accepted, else -1 (at least 1).
        An empty proposal leaves K unchanged."""
        if self.schedule == "heuristic" and self.proposed > 0:
            self.k = self.k + 2 if accepted == self.proposed else max(1, self.k - 1)


__all__ = ["DraftModelProposer", "check_confidence_threshold", "last_logits", "takes_logits_to_keep"]
