"""The tree decoder drives its drafter through the per-request protocol only (start, then draft and accept in turn,
select as rows leave), hands accept the committed path's tokens and the target's own features at those positions,
and a stateful drafter defined here decodes exactly greedy."""

from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor

from inference.decoders import DecodeConfig, TreeDecoder
import inference.decoders.tree as medusa
from medusa_train.models.features import FINAL
from medusa_train.tree.buffers import TreeBuffers
from medusa_train.models.tree_drafter import TreeDrafter
from tests.conftest import make_tiny_model
from tests.inference.test_decoders import PROMPTS, SMALL_TREE, check_counts, greedy, random_medusa

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder:
    """Forwards every call to ``drafter`` and records it: ``events`` holds ``(name, arguments)`` in call order."""

    def __init__(self, drafter: TreeDrafter) -> None:
        self.drafter = drafter
        self.events: list[tuple[str, dict]] = []

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        self.events.append(("start", {"features": {k: v.clone() for k, v in features.items()}, "tokens": tokens.clone(),
                                      "valid": valid.clone()}))
        self.drafter.start(features, tokens, valid)

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        nodes = self.drafter.draft(root, tree)
        self.events.append(("draft", {"root": root.tolist(), "nodes": nodes.tolist()}))
        return nodes

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        copied = {k: v.clone() for k, v in features.items()}
        self.events.append(("accept", {"tokens": tokens.tolist(), "features": copied, "length": length.tolist()}))
        self.drafter.accept(tokens, features, length)

    def select(self, keep: Tensor) -> None:
        self.events.append(("select", {"keep": keep.tolist()}))
        self.drafter.select(keep)


class FollowerDrafter:
    """A stateful toy drafter: it keeps each row's committed sequence (from start and accept) and fills every depth-d
    node with the d-th token of the chain root -> follower(root) -> ..., follower(x) the token that followed x's last
    occurrence in the row's sequence (0 when none did)."""

    def __init__(self) -> None:
        self.sequences: list[list[int]] = []

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        self.sequences = [row[mask].tolist() for row, mask in zip(tokens, valid)]

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        chains = []
        for sequence, token in zip(self.sequences, root.tolist()):
            follows = {a: b for a, b in zip(sequence, sequence[1:])}  # the last occurrence wins
            chain = [token]
            for _ in range(tree.max_depth):
                chain.append(follows.get(chain[-1], 0))
            chains.append(chain)
        return torch.tensor(chains, device=root.device)[:, tree.position_ids]  # [B, N]: a node's depth picks

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        for sequence, row, n in zip(self.sequences, tokens.tolist(), length.tolist()):
            sequence.extend(row[:n])

    def select(self, keep: Tensor) -> None:
        self.sequences = [self.sequences[i] for i in keep.tolist()]


def test_the_decoder_starts_drafts_accepts_and_selects_with_the_committed_path_and_its_features(monkeypatch):
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_medusa(base), SMALL_TREE, topk=10)
    recorder = Recorder(decoder.drafter)
    decoder.drafter = recorder
    steps: list[list[list[int]]] = []  # each step's emitted tokens per active row, before any trimming
    original_step = medusa.tree_step

    def step(*args, **kwargs):
        result = original_step(*args, **kwargs)
        steps.append(result.tokens)
        return result

    monkeypatch.setattr(medusa, "tree_step", step)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    results = decoder.generate_batch(prompts, DecodeConfig(max_new_tokens=30))
    assert [r.tokens for r in results] == [greedy(base, p, 30) for p in prompts]

    names = "".join({"start": "S", "draft": "D", "accept": "A", "select": "L"}[name] for name, _ in recorder.events)
    assert re.fullmatch(r"S(L?DA)+", names), names  # start once; then draft and accept in turn; select between
    assert names.count("D") == len(steps) == max(r.forward_passes for r in results)
    assert "L" in names  # rows finished at different steps and left the batch

    # start: the prompts, left-padded, and the target's final hidden states at the prompt positions
    _, start = recorder.events[0]
    committed = [list(p) for p in prompts]  # each row's sequence in the target's cache
    for b, prompt in enumerate(prompts):
        assert start["tokens"][b][start["valid"][b]].tolist() == prompt
    start_final = [start["features"][FINAL][b][start["valid"][b]] for b in range(len(prompts))]

    active = list(range(len(prompts)))  # original row of each batch row
    roots = {b: results[b].tokens[0] for b in active}  # each row's emitted, not yet committed token
    accepted: dict[int, list[Tensor]] = {b: [] for b in active}  # accept's final features per original row
    step_index = 0
    for name, event in recorder.events[1:]:
        if name == "select":
            active = [active[i] for i in event["keep"]]
            # the rows kept are exactly those still decoding: one that finished after its last step left
            assert active == [b for b in range(len(prompts)) if results[b].forward_passes > step_index]
        elif name == "draft":
            assert event["root"] == [roots[b] for b in active]
            assert all(nodes[0] == roots[b] for nodes, b in zip(event["nodes"], active))
        else:
            emitted = steps[step_index]
            step_index += 1
            width = max(event["length"])
            for i, b in enumerate(active):
                n = event["length"][i]
                assert n == len(emitted[i]) and len(event["tokens"][i]) == width
                # root first, then the step's accepted drafts (its emitted tokens but the last), -1 after
                assert event["tokens"][i] == [roots[b]] + emitted[i][:-1] + [-1] * (width - n)
                final = event["features"][FINAL][i]  # [W, H]
                assert torch.equal(final[n:], final[n - 1].expand(width - n, -1))  # padding: the last node's
                accepted[b].append(final[:n])
                committed[b].extend(event["tokens"][i][:n])
                roots[b] = emitted[i][-1]
    assert step_index == len(steps)
    assert max(len(e) for s in steps for e in s) > 1  # some step accepted drafts: a multi-position path was checked

    for b, prompt in enumerate(prompts):
        # the committed sequences are each prompt and its reply but the last token (emitted, never verified)
        assert committed[b] == prompt + results[b].tokens[:-1]
        with torch.no_grad():
            full = base.base_model(torch.tensor([committed[b]])).last_hidden_state[0]  # [S, H], fp32
        features = torch.cat([start_final[b]] + accepted[b])
        assert features.shape == full.shape
        torch.testing.assert_close(features, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_stateful_drafter_decodes_exactly_greedy(family):
    base = make_tiny_model(family)
    decoder = TreeDecoder(random_medusa(base), SMALL_TREE, topk=10)
    drafter = FollowerDrafter()
    decoder.drafter = drafter
    config = DecodeConfig(max_new_tokens=40)
    expected = [greedy(base, p, 40) for p in PROMPTS]
    alone = [decoder.generate(p, config) for p in PROMPTS]
    # its own state: the committed sequence (the last step may have committed tokens beyond max_new_tokens)
    committed = PROMPTS[-1] + expected[-1][:-1]
    assert len(drafter.sequences) == 1 and drafter.sequences[0][: len(committed)] == committed
    batch = decoder.generate_batch(list(PROMPTS), config)
    assert [r.tokens for r in alone] == expected
    assert [r.tokens for r in batch] == expected
    for r in alone + batch:
        check_counts(r)
    # what accept hands it is what makes it draft well: a tiny random model repeats itself, so the root's follower in
    # the sequence so far is often right (2.4 for llama, 3.3 for gpt2; from the prompts alone, without accept: 1.0)
    assert sum(r.mean_accepted_tokens for r in alone) / len(alone) > 2.0


def test_the_tree_decoder_is_named_for_the_registry():
    assert TreeDecoder.name == "tree"  # the registry's decoder name
