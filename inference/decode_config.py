"""One generation request (:class:`DecodeConfig`): what every decoder (:mod:`inference.decoders`) and every proposer
(:mod:`inference.proposers`) reads of it, below both, so that a proposer needs nothing of the decoders that drive it.
"""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.tree.sampling import SAMPLING_DEFAULTS, is_greedy


@dataclass(frozen=True)
class DecodeConfig:
    """One generation request.

    Attributes:
        max_new_tokens: most new tokens to return (>= 1); the output is cut to exactly this many at most.
        temperature: 0 for greedy decoding, > 0 to sample.
        top_p: nucleus mass in (0, 1]; 1.0 turns it off (sampling only).
        top_k: keep the k most likely tokens; 0 turns it off (sampling only).
        eos_token_ids: generation stops after the first of these (the EOS token is kept in the output).
        stop_strings: generation stops at the first token whose text completes one of these (the decoder needs a
            tokenizer); the token is kept.
        seed: seed of the sampling generator; None draws a fresh one.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    max_new_tokens: int
    temperature: float = SAMPLING_DEFAULTS.temperature
    top_p: float = SAMPLING_DEFAULTS.top_p
    top_k: int = SAMPLING_DEFAULTS.top_k
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        is_greedy(self.temperature)  # raises on a negative / NaN / infinite temperature
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p!r}")
        eos = (self.eos_token_ids,) if isinstance(self.eos_token_ids, int) else tuple(self.eos_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos):
            raise ValueError(f"eos_token_ids must be non-negative ints, got {self.eos_token_ids!r}")
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "eos_token_ids", eos)
        object.__setattr__(self, "stop_strings", stops)

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return is_greedy(self.temperature)


__all__ = ["DecodeConfig"]
