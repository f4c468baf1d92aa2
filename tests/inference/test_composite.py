"""The composite tree decoder: the heads' candidates and prompt lookup's in one tree. Greedy output equals plain
greedy decoding for every drafter type (one row, a batch, static and dynamic trees); engineered inputs where the
lookup's path is accepted, where the heads' is, and where both share a prefix; the lookup's first draft equals
transformers' prompt lookup; bad settings are refused by name before decoding."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from inference.decoders import DecodeConfig, TreeDecoder
from inference.proposers.composite import CompositeShape, merge, priority_order
from inference.proposers.prompt_lookup import NgramIndex
from inference.registry import decoder_settings
from medusa_train.models.catalog import head_types
from medusa_train.tree.buffers import build_tree_buffers
from medusa_train.tree.composite import CompositeTree, composite_tree
from tests.conftest import make_tiny_model
from tests.inference.test_decoders import (
    PROMPTS,
    SMALL_TREE,
    LookupHeadsMedusa,
    check_counts,
    greedy,
    random_heads,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SPLIT = {"nodes": 20, "lookup_length": 5, "lookup_matches": 2}


class Recorder:
    """Wraps the composite drafter: the merged tree of every step."""

    def __init__(self, drafter) -> None:
        self.drafter, self.trees = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft_dynamic(self, root, shape):
        tokens, tree = self.drafter.draft_dynamic(root, shape)
        self.trees.append((tokens[0].tolist(), tree))
        return tokens, tree


class WrongDrafter:
    """A tree drafter whose every node holds ``token`` (never the target's next token in the tests using it)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def start(self, *args) -> None: ...

    def accept(self, *args) -> None: ...

    def select(self, keep) -> None: ...

    def draft(self, root, tree):
        tokens = torch.full((root.shape[0], tree.num_nodes), self.token, dtype=torch.long)
        tokens[:, 0] = root
        return tokens


def looping_prompt(base):
    """A prompt whose greedy continuation repeats a stretch of the prompt (a random tiny model falls into a loop),
    and that continuation."""
    continuation = greedy(base, PROMPTS[0], 60)
    prompt = PROMPTS[0] + continuation[:30]
    return prompt, greedy(base, prompt, 30)


# --- greedy = plain greedy ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_type", head_types())  # every type in the drafter catalog
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_composite_greedy_equals_plain_greedy(family, head_type):
    base = make_tiny_model(family)
    model = random_heads(head_type, base)
    decoder = TreeDecoder(model, SMALL_TREE, topk=10, composite=SPLIT)
    prompts = [*PROMPTS, looping_prompt(base)[0]]
    for prompt in prompts:
        result = decoder.generate(prompt, DecodeConfig(max_new_tokens=40))
        assert result.tokens == greedy(base, prompt, 40), (family, head_type, prompt)
        check_counts(result)
    batch = decoder.generate_batch(prompts, DecodeConfig(max_new_tokens=30))
    assert [r.tokens for r in batch] == [greedy(base, p, 30) for p in prompts]


def test_composite_over_a_dynamic_tree_and_the_sampling_rules_at_temperature_zero():
    base = make_tiny_model("llama")
    model = random_heads("eagle3", base)
    prompt = looping_prompt(base)[0]
    dynamic = TreeDecoder(model, None, dynamic_tree=(3, 3, 8), composite={"nodes": 12, "lookup_length": 4})
    assert dynamic.generate(prompt, DecodeConfig(max_new_tokens=30)).tokens == greedy(base, prompt, 30)
    for acceptance in ("typical", "speculative"):
        decoder = TreeDecoder(model, SMALL_TREE, topk=10, acceptance=acceptance, composite=SPLIT)
        assert decoder.generate(prompt, DecodeConfig(max_new_tokens=30)).tokens == greedy(base, prompt, 30)


def test_sampling_is_reproducible_by_seed():
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_heads("medusa", base), SMALL_TREE, topk=10, acceptance="speculative",
                          composite=SPLIT)
    runs = [decoder.generate(PROMPTS[2], DecodeConfig(max_new_tokens=20, temperature=0.8, seed=s)) for s in (3, 3, 4)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens


# --- engineered inputs: which path is accepted ----------------------------------------------------------------------

def test_the_lookup_path_is_accepted_where_the_heads_are_always_wrong():
    base = make_tiny_model("llama")
    prompt, expected = looping_prompt(base)
    wrong = next(t for t in range(3, 97) if t not in prompt + expected)
    model = random_heads("medusa", base)
    heads_only = TreeDecoder(model, SMALL_TREE, topk=10)
    heads_only.drafter = WrongDrafter(wrong)
    composite = TreeDecoder(model, SMALL_TREE, topk=10, composite={"nodes": 20, "lookup_length": 5})
    composite.drafter.inner = WrongDrafter(wrong)
    alone = heads_only.generate(prompt, DecodeConfig(max_new_tokens=30))
    both = composite.generate(prompt, DecodeConfig(max_new_tokens=30))
    assert alone.tokens == both.tokens == expected
    assert set(alone.accepted_lengths) == {1}  # the heads' nodes never hold the next token
    assert max(both.accepted_lengths) == 6  # a whole lookup draft (5 tokens) and the bonus token
    assert both.forward_passes < alone.forward_passes


def test_the_heads_path_is_accepted_where_the_heads_are_perfect():
    base = make_tiny_model("llama")
    prompt = [1] + list(range(3, 97))  # every token once: the lookup always drafts the next ids, rarely right
    continuation = greedy(base, prompt, 40)
    model = LookupHeadsMedusa(base, 3, prompt + continuation)
    decoder = TreeDecoder(model, SMALL_TREE, topk=10, composite={"nodes": 18, "lookup_length": 2})
    decoder.drafter = recorder = Recorder(decoder.drafter)
    result = decoder.generate(prompt, DecodeConfig(max_new_tokens=25))
    assert result.tokens == continuation[:25]
    assert result.accepted_lengths == [4] * 6  # the heads' depth-3 path and the bonus token, every step
    # the lookup's 2-token drafts were in the trees beside the heads' 15 nodes
    assert sum(tree.num_nodes == 1 + 15 + 2 for _, tree in recorder.trees) >= 4


def test_a_lookup_draft_that_begins_with_the_heads_path_shares_its_nodes():
    base = make_tiny_model("llama")
    prompt, expected = looping_prompt(base)
    model = LookupHeadsMedusa(base, 3, prompt + expected + expected)
    decoder = TreeDecoder(model, SMALL_TREE, topk=10, composite={"nodes": 40, "lookup_length": 8})
    decoder.drafter = recorder = Recorder(decoder.drafter)
    result = decoder.generate(prompt, DecodeConfig(max_new_tokens=27))
    assert result.tokens == expected[:27]
    assert result.accepted_lengths[0] == 9  # the lookup draft (8 tokens) is longer than the heads' path (3)
    tokens, tree = recorder.trees[0]
    # merged: 15 heads' nodes + 8 lookup tokens, less the 3 the lookup draft shares with the heads' top-1 path
    assert tree.num_nodes == 1 + 15 + 8 - 3
    chain = [tree.paths.index(p) + 1 for p in [(0,) * d for d in range(1, 9)]]
    assert [tokens[n] for n in chain] == expected[1:9]


# --- the merged tree -------------------------------------------------------------------------------------------------

def test_merge_puts_the_lookup_first_shares_prefixes_and_keeps_the_budget():
    # the drafter's tree: root -> a(1), b(2); a -> c(3); its tokens
    heads = build_tree_buffers([[0], [1], [0, 0]], 2, 2)
    head_tokens = [9, 5, 7, 6]
    parents = heads.parents.tolist()
    order = priority_order([[0], [0, 0], [1]], heads)
    assert order == (1, 3, 2)  # the given order: every prefix of it is a tree
    assert priority_order([[0, 0], [0], [1]], heads) == (1, 2, 3)  # not: node order
    # a lookup draft 5, 6, 8 shares a -> c with the heads: 3 + 3 - 2 nodes
    paths, tokens = merge(9, [[5, 6, 8]], head_tokens, parents, order, budget=10)
    assert list(zip(paths, tokens)) == [((0,), 5), ((0, 0), 6), ((0, 0, 0), 8), ((1,), 7)]
    # the budget: the lookup draft first, then the heads' best nodes
    paths, tokens = merge(9, [[4, 4, 4]], head_tokens, parents, order, budget=4)
    assert list(zip(paths, tokens)) == [((0,), 4), ((0, 0), 4), ((0, 0, 0), 4), ((1,), 5)]
    # no lookup match: the heads alone, in their priority order
    assert merge(9, [], head_tokens, parents, order, budget=10) == ([(0,), (0, 0), (1,)], [5, 6, 7])


def test_the_lookups_first_draft_is_transformers_prompt_lookup():
    rng = random.Random(0)
    for trial in range(200):
        sequence = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        length, ngram = rng.randrange(1, 8), rng.randrange(1, 4)
        hf = PromptLookupCandidateGenerator(num_output_tokens=length, max_matching_ngram_size=ngram, max_length=1000)
        candidates, _ = hf.get_candidates(torch.tensor([sequence]))
        expected = candidates[0, len(sequence):].tolist()
        drafts = NgramIndex(ngram, sequence[:-1]).continuations(sequence[-1], length, matches=3)
        assert (drafts[0] if drafts else []) == expected, (sequence, length, ngram)
        assert len({tuple(d) for d in drafts}) == len(drafts) and all(1 <= len(d) <= length for d in drafts)


def test_the_index_grows_with_the_reply():
    index = NgramIndex(2, [1, 2, 3])
    assert index.continuations(1, 4) == [[2, 3, 1]]  # the root closes the draft
    index.extend([1, 2, 4])
    assert index.continuations(2, 3, matches=2) == [[3, 1, 2], [4, 2]]  # "1 2" twice, earliest first


# --- bad input -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    ({"nodes": 4, "lookup_length": 5}, r"composite\.nodes=4 is smaller than the lookup drafts' 5 tokens"),
    ({"nodes": 9, "lookup_length": 5, "lookup_matches": 2}, r"composite\.nodes=9 is smaller .* 10 tokens"),
    ({"nodes": 10, "lookup_length": 0}, r"composite\.lookup_length must be a positive int, got 0"),
    ({"nodes": 10, "lookup_matches": True}, r"composite\.lookup_matches must be a positive int"),
    ({"lookup_length": 3}, r"composite takes the keys .* \(nodes required\)"),
    ({"nodes": 10, "lookup": 3}, r"composite takes the keys"),
])
def test_bad_splits_are_refused_by_name_before_decoding(fields, message):
    with pytest.raises(ValueError, match=message):
        composite_tree(fields)
    base = make_tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        TreeDecoder(random_heads("medusa", base), SMALL_TREE, topk=10, composite=fields)


@pytest.mark.parametrize("fields,message", [
    ({"lookup_length": 0}, r"decoder\.composite\.lookup_length must be >= 1"),
    ({"nodes": 3, "lookup_length": 5}, r"decoder\.composite\.nodes=3 is smaller than the lookup drafts' 5 tokens"),
    ({"nodes": 0}, r"decoder\.composite\.nodes must be >= 1"),
])
def test_bad_settings_are_refused_by_the_registry_before_any_model_loads(fields, message):
    with pytest.raises(ValueError, match=message):
        decoder_settings("composite", fields)


def test_the_shape_bounds_the_cache_and_the_depth():
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_heads("medusa", base), SMALL_TREE, topk=10, composite=SPLIT)
    assert isinstance(decoder.tree, CompositeShape)
    assert decoder.tree.num_nodes == 21 and decoder.tree.max_depth == 5  # the lookup draft is deeper than the heads'
    assert decoder.composite == CompositeTree(20, 5, 2)
