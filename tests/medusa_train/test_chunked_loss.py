"""The chunked linear cross entropy against the logits computed at once: loss, gradients, metrics, memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa_train.training.chunked_loss import chunked_linear_ce, linear_teacher, rows_teacher

R, H, V = 11, 6, 9


def reference(features, weight, targets, row_weight, group_sizes=None, teacher_logits=None):
    """The same loss from ``[R, V']`` logits held at once (autograd through them), and the rows' hits."""
    if weight.dim() == 3:
        groups = torch.repeat_interleave(torch.arange(weight.shape[0]), torch.tensor(group_sizes))
        logits = torch.einsum("rh,rvh->rv", features, weight[groups])
    else:
        logits = features @ weight.T
    if teacher_logits is None:
        per_row = F.cross_entropy(logits, targets.clamp_min(0), reduction="none") * (targets >= 0)
    else:
        logq = F.log_softmax(teacher_logits, dim=-1)
        per_row = (logq.exp() * (logq - F.log_softmax(logits, dim=-1))).sum(-1)
    top = logits.topk(5, dim=-1).indices
    return (row_weight * per_row).sum(), per_row.detach(), top[:, 0] == targets, (top == targets[:, None]).any(-1)


def inputs(seed=0, groups=None, weight_grad=True):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(R, H, generator=g, requires_grad=True)
    shape = (V, H) if groups is None else (len(groups), V, H)
    weight = torch.randn(*shape, generator=g).requires_grad_(weight_grad)
    targets = torch.randint(0, V, (R,), generator=g)
    targets[[2, 7]] = -1  # no hard target (outside a reduced head vocabulary): loss 0, a miss
    row_weight = 0.8 ** torch.randint(0, 3, (R,), generator=g).float()
    return features, weight, targets, row_weight


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t.requires_grad])


@pytest.mark.parametrize("chunk", [1, 7, R, R + 5])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("groups", [None, [4, 0, 7]])  # one shared projection, or one per head (an empty head)
def test_chunked_loss_gradients_and_metrics_equal_the_logits_held_at_once(chunk, soft, groups):
    features, weight, targets, row_weight = inputs(groups=groups)
    teacher_logits = torch.randn(R, V, generator=torch.Generator().manual_seed(1)) * 2 if soft else None
    teacher = (lambda s, e: teacher_logits[s:e]) if soft else None
    out = chunked_linear_ce(features, weight, targets, chunk_size=chunk, row_weight=row_weight, group_sizes=groups,
                            teacher=teacher)
    loss, per_row, top1, top5 = reference(features, weight, targets, row_weight, groups, teacher_logits)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert torch.allclose(out.row_loss, per_row, rtol=1e-6, atol=1e-6)
    if not soft:
        assert out.row_loss[[2, 7]].tolist() == [0.0, 0.0]
    assert out.top1.tolist() == top1.tolist() and out.top5.tolist() == top5.tolist()
    assert not out.top1[[2, 7]].any() and not out.top5[[2, 7]].any()
    for got, want in zip(grads(out.loss, features, weight), grads(loss, features, weight)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if groups is not None:  # the empty group's projection gets a zero gradient
        assert grads(chunked_linear_ce(features, weight, targets, chunk_size=chunk, group_sizes=groups).loss,
                     weight)[0][1].abs().sum() == 0


def test_a_frozen_weight_gets_no_gradient_and_the_features_theirs():
    features, weight, targets, row_weight = inputs(weight_grad=False)
    out = chunked_linear_ce(features, weight, targets, chunk_size=4, row_weight=row_weight)
    out.loss.backward()
    assert weight.grad is None
    want = torch.autograd.grad(reference(features, weight, targets, row_weight)[0], features)[0]
    assert torch.allclose(features.grad, want, rtol=1e-5, atol=1e-6)


def test_gradcheck_in_float64_hard_and_soft():
    g = torch.Generator().manual_seed(3)
    features = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(2, 7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([1, -1, 6, 0, 3])
    teacher_logits = torch.randn(5, 7, dtype=torch.float64, generator=g)
    for teacher in (None, lambda s, e: teacher_logits[s:e]):
        assert torch.autograd.gradcheck(
            lambda x, w: chunked_linear_ce(x, w, targets, chunk_size=2, group_sizes=[3, 2], teacher=teacher,
                                           row_weight=torch.tensor([1.0, 0.5, 0.8, 0.8, 0.64])).loss,
            (features, weight))


def test_under_autocast_both_passes_project_in_bfloat16_like_the_logits_held_at_once():
    features, weight, targets, row_weight = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_ce(features, weight, targets, chunk_size=4, row_weight=row_weight)
        got = grads(out.loss, features, weight)
        logits = (features @ weight.T).float()  # bf16 products, as autocast runs them
        per_row = F.cross_entropy(logits, targets.clamp_min(0), reduction="none") * (targets >= 0)
        loss = (row_weight * per_row).sum()
        want = grads(loss, features, weight)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    fp32 = grads(reference(features, weight, targets, row_weight)[0], features, weight)
    for g, w, f in zip(got, want, fp32):
        assert torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2)
        assert not torch.equal(g.float(), f)  # the products were bf16, not fp32


def test_no_rows_give_zero_loss_and_zero_gradients():
    features = torch.zeros(0, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    out = chunked_linear_ce(features, weight, torch.zeros(0, dtype=torch.long), chunk_size=3)
    out.loss.backward()
    assert out.loss.item() == 0.0 and weight.grad.abs().sum() == 0 and features.grad.shape == (0, H)


def test_only_one_chunk_of_logits_is_saved_for_backward():
    """What autograd keeps between the passes: the inputs, never the ``[R, V]`` logits (the reference keeps them)."""
    big_v = 4096
    features = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(big_v, 8, requires_grad=True)
    targets = torch.randint(0, big_v, (64,))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_linear_ce(features, weight, targets, chunk_size=16)
    assert max(saved) == big_v * 8  # the weight itself; nothing of R x V
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference(features, weight, targets, torch.ones(64))
    assert max(saved) >= 64 * big_v


def test_teachers_read_rows_of_features_or_of_logits():
    hidden = torch.randn(2, 5, H)
    lm_head = torch.randn(V, H)
    token_map = torch.tensor([0, 3, 4, 8])
    b, t = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 2])
    want = (hidden[b, t] @ lm_head.T)[:, token_map]
    assert torch.allclose(linear_teacher(hidden[b, t], lm_head[token_map])(1, 3), want[1:3])
    assert torch.allclose(rows_teacher(hidden @ lm_head.T, b, t, token_map)(0, 2), want[:2], atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(group_sizes=[3, 3]), "group_sizes"),
    (dict(targets=torch.zeros(R - 1, dtype=torch.long)), "targets"),
])
def test_bad_arguments_are_named(bad, message):
    features, weight, targets, _ = inputs()
    kwargs = {"targets": targets, "chunk_size": 4, **bad}
    with pytest.raises(ValueError, match=message):
        chunked_linear_ce(features, weight, **kwargs)
