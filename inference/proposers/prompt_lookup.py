"""Prompt lookup: draft the tokens that followed an earlier occurrence of the sequence's last n-gram.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding; in
transformers as ``generate(prompt_lookup_num_tokens=...)``, ``PromptLookupCandidateGenerator``) matches the last n
tokens of the committed sequence against the sequence itself (the prompt and the reply so far), from the longest
n-gram (``max_matching_ngram_size``) down to one token, and drafts the ``length`` tokens that followed the first
(earliest) match. :class:`NgramIndex` applies that rule incrementally and can return several distinct continuations
(``matches``): the first is transformers' draft, the others follow the next matches in the same order.

Terms as in :mod:`inference.proposers.base`: the **root** is the last emitted token, not yet read by the target; the
lookup runs over the committed sequence with the root last. Its default settings (``LOOKUP_LENGTH``,
``MAX_MATCHING_NGRAM_SIZE``) are :mod:`medusa_train.tree.composite`'s.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """The positions of every n-gram (1 <= n <= ``max_ngram``) of one growing token sequence.

    Args:
        max_ngram: the longest n-gram matched (``max_matching_ngram_size``), >= 1.
        tokens: the sequence so far (e.g. the prompt).

    Raises:
        ValueError: ``max_ngram`` < 1.
    """

    def __init__(self, max_ngram: int, tokens: Iterable[int] = ()) -> None:
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_matching_ngram_size must be a positive int, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions (index after its last token)
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens (ids), indexing the n-grams that end at each."""
        seq, ends = self.tokens, self._ends
        for token in tokens:
            seq.append(int(token))
            end = len(seq)
            for n in range(1, min(self.max_ngram, end) + 1):
                ends.setdefault(tuple(seq[end - n:end]), []).append(end)

    def continuations(self, root: int, length: int, matches: int = 1) -> list[list[int]]:
        """Up to ``matches`` distinct drafts of at most ``length`` tokens continuing ``root``.

        The query is the last n tokens of ``tokens + [root]``, n from ``max_ngram`` down to 1; each earlier
        occurrence (earliest first) gives the tokens after it (the root included when the occurrence ends at the
        last committed token). The first draft is transformers' prompt lookup draft for the same sequence.

        Args:
            root: the root token id.
            length: drafted tokens per continuation, >= 1.
            matches: distinct continuations wanted, >= 1.

        Returns:
            The drafts, best first, each non-empty; an empty list when the last token never occurred before.
        """
        seq = self.tokens
        committed = len(seq)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, committed), 0, -1):
            query = tuple(seq[committed - n + 1:]) + (root,) if n > 1 else (root,)
            for end in self._ends.get(query, ()):
                draft = seq[end:end + length]
                if end + length > committed:
                    draft = draft + [root]
                key = tuple(draft)
                if key in seen:
                    continue
                seen.add(key)
                found.append(draft)
                if len(found) == matches:
                    return found
        return found


__all__ = ["NgramIndex"]
