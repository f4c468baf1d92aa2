"""The composite tree's settings: how one step's node budget splits between prompt lookup's drafts and a tree
drafter's nodes (the merge itself, a proposer, is :mod:`inference.proposers.composite`).

The settings sit below the decoders, the tree tuner and the export (``composite_tree.json``,
:mod:`medusa_train.export.tree_files`), which all validate them with :class:`CompositeTree`. Prompt lookup's two
defaults live here too: the composite split and the prompt-lookup decoder both start from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# transformers' PromptLookupCandidateGenerator defaults (num_output_tokens=10, max_matching_ngram_size=2),
# the values medusa-eval's hf_prompt_lookup row runs with too.
LOOKUP_LENGTH = 10
MAX_MATCHING_NGRAM_SIZE = 2
LOOKUP_MATCHES = 1  # distinct lookup drafts per step: prompt lookup's one


@dataclass(frozen=True)
class CompositeTree:
    """How a composite step splits its node budget (the merged tree: :mod:`inference.proposers.composite`).

    Attributes:
        nodes: the node budget of a step's tree (root excluded): lookup drafts first, the drafter's nodes fill the
            rest; the tree pass verifies at most ``nodes + 1`` tokens.
        lookup_length: tokens per lookup draft (transformers' ``prompt_lookup_num_tokens``).
        lookup_matches: distinct lookup drafts per step.
        max_matching_ngram_size: the longest n-gram matched against the context.

    Raises:
        ValueError: a field that is not a positive int (a lookup length of 0 included), or ``nodes`` below the
            lookup drafts' ``lookup_length * lookup_matches`` (the message names ``composite.<field>``).
    """

    nodes: int
    lookup_length: int = LOOKUP_LENGTH
    lookup_matches: int = LOOKUP_MATCHES
    max_matching_ngram_size: int = MAX_MATCHING_NGRAM_SIZE

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"composite.{name} must be a positive int, got {value!r}")
        lookup = self.lookup_length * self.lookup_matches
        if self.nodes < lookup:
            raise ValueError(f"composite.nodes={self.nodes} is smaller than the lookup drafts' {lookup} tokens "
                             f"(composite.lookup_length={self.lookup_length} x composite.lookup_matches="
                             f"{self.lookup_matches}): raise composite.nodes to at least {lookup}, or shorten the "
                             "lookup")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


KEYS = tuple(CompositeTree.__dataclass_fields__)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(CompositeTree) if f.default is not dataclasses.MISSING}


def setting_split(prefix: str = "decoder.composite", **fields: int) -> CompositeTree:
    """``CompositeTree(**fields)`` with its errors naming the settings (``<prefix>.<field>``) instead of
    ``composite.<field>``.

    Raises:
        ValueError: as :class:`CompositeTree`.
    """
    try:
        return CompositeTree(**fields)
    except ValueError as e:
        raise ValueError(str(e).replace("composite.", f"{prefix}.")) from None


def composite_tree(value: CompositeTree | Mapping[str, Any] | None) -> CompositeTree | None:
    """A :class:`CompositeTree` from itself or a mapping of its fields (``nodes`` required); None stays None.

    Raises:
        ValueError: another form, an unknown or missing key, or invalid fields (as :class:`CompositeTree`).
    """
    if value is None or isinstance(value, CompositeTree):
        return value
    if not (isinstance(value, Mapping) or hasattr(value, "keys")):
        raise ValueError(f"composite must be a mapping of {list(KEYS)}, got {value!r}")
    unknown = set(value.keys()) - set(KEYS)
    if unknown or "nodes" not in value:  # sorted by str: the keys need not be strings
        raise ValueError(f"composite takes the keys {list(KEYS)} (nodes required), got "
                         f"{sorted(value.keys(), key=str)}")
    return CompositeTree(**{key: value[key] for key in value.keys()})


__all__ = ["DEFAULTS", "KEYS", "LOOKUP_LENGTH", "LOOKUP_MATCHES", "MAX_MATCHING_NGRAM_SIZE", "CompositeTree",
           "composite_tree", "setting_split"]
