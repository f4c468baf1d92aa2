"""The verifier: which drafted tokens to keep after one target-model pass, and the token that follows them.

Terms (as in vLLM's ``RejectionSampler``, ``vllm/v1/sample/rejection_sampler.py``):

- **accepted tokens**: drafted tokens the verifier keeps, a prefix of one drafted path (chain or tree branch).
- **recovered token**: when a drafted token is rejected (in a tree: it and every remaining sibling), the token
  emitted in its place, drawn from the residual target distribution (argmax of the target when greedy); the step
  ends there.
- **bonus token**: when the walk reaches a node with no children (every drafted token on the path was accepted),
  the token drawn from the target distribution at that node; it is free, the target pass already computed it.

Each step therefore emits its accepted tokens plus exactly one recovered-or-bonus token, called ``next_token``
below. Drafted positions that are padding (paths shorter than the tree depth) are never accepted.

Rules, and where they come from:

- :func:`greedy_accept` (temperature 0): keep the longest drafted prefix equal to the target's argmax chain
  (Medusa, Cai et al. 2024, Sec. 2.1.2; Stern et al. 2018 blockwise parallel decoding). Lossless: the output is
  exactly greedy decoding's.
- :func:`typical_accept`: Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1): accept drafted token x when
  ``p(x) > min(epsilon, delta * exp(-H(p)))``, p the target distribution at the temperature. LOSSY: the output
  does not follow the target distribution; it trades fidelity for longer accepts.
- :func:`tree_speculative_sample_batch` and :func:`chain_speculative_sample`: speculative sampling, lossless at any
  temperature (the output has exactly the target's distribution). For a chain: Leviathan et al. 2023, "Fast
  Inference from Transformers via Speculative Decoding", Sec. 2.3 / Algorithm 1, and Chen et al. 2023,
  "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2. For a tree: the
  multi-draft recursive rejection sampling of SpecInfer (Miao et al. 2024, "multi-step speculative sampling") and
  EAGLE (Li et al. 2024, Sec. 3.3), where the children of a node are tried in rank order against a residual
  target distribution. A chain is the one-child tree, so both go through one implementation.

Shapes: B batch rows, P root-to-leaf paths, D tree depth, N tree nodes, K draft length, V vocabulary.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from medusa_train.tree.buffers import TreeBuffers, build_tree_buffers, chain_choices
from medusa_train.tree.sampling import greedy_tokens, is_greedy, logits_to_probs


def _check_path_inputs(candidates: Tensor, target_logits_at_paths: Tensor, valid: Tensor) -> None:
    if candidates.ndim != 3 or candidates.dtype != torch.long:
        raise ValueError(f"candidates must be long [B, P, D+1], got {candidates.dtype} {tuple(candidates.shape)}")
    if target_logits_at_paths.ndim != 4 or target_logits_at_paths.shape[:3] != candidates.shape:
        raise ValueError(
            f"target_logits_at_paths must be [B, P, D+1, V] = [{', '.join(map(str, candidates.shape))}, V], "
            f"got {tuple(target_logits_at_paths.shape)}"
        )
    if valid.dtype != torch.bool or valid.shape != candidates.shape[1:]:
        raise ValueError(
            f"valid must be bool [P, D+1] = {tuple(candidates.shape[1:])} (tree.retrieve_valid), "
            f"got {valid.dtype} {tuple(valid.shape)}"
        )


def _accepted_prefix(accepted: Tensor) -> Tensor:
    """bool [..., D] per-position verdicts -> bool [..., D], True on the accepted prefix only."""
    return torch.cumprod(accepted.to(torch.long), dim=-1).to(torch.bool)


def greedy_accept(
    candidates: Tensor, target_logits_at_paths: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy verification: keep the longest path prefix that matches the target's argmax.

    Args:
        candidates: long [B, P, D+1]; ``candidates[:, p, 0]`` is the root token (already accepted),
            ``candidates[:, p, j]`` the j-th drafted token on path p. Padding positions may hold anything.
        target_logits_at_paths: float [B, P, D+1, V]; target logits at each path position, i.e. the
            prediction for the token after ``candidates[:, p, j]``.
        valid: bool [P, D+1]; False at padding positions (``tree.retrieve_valid``).

    Returns:
        ``(best_path, accept_length, next_token)``, each long [B]: the chosen path (lowest index among the
        longest), the number of drafted tokens accepted (0..D), and the argmax of the target logits at the last
        accepted position (the recovered token, or the bonus token when the whole path was accepted).

    Raises:
        ValueError: shapes or dtypes do not match the above.
    """
    _check_path_inputs(candidates, target_logits_at_paths, valid)
    return greedy_accept_tokens(candidates, greedy_tokens(target_logits_at_paths), valid)


def greedy_accept_tokens(candidates: Tensor, target_tokens: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`greedy_accept` from the target's argmax tokens ``[B, P, D+1]`` instead of its logits: a tree
    verifier takes the argmax once per node (``[B, N]``) and lays the tokens out along the paths, instead of
    copying N·V logits into P·(D+1)·V. Same results; shapes of ``candidates`` and ``valid`` as there."""
    if target_tokens.shape != candidates.shape or target_tokens.dtype != torch.long:
        raise ValueError(f"target_tokens must be long {tuple(candidates.shape)} (candidates' shape), got "
                         f"{target_tokens.dtype} {tuple(target_tokens.shape)}")
    matches = (candidates[..., 1:] == target_tokens[..., :-1]) & valid[:, 1:]  # [B, P, D]
    lengths = _accepted_prefix(matches).sum(dim=-1)  # [B, P]
    best_path = lengths.argmax(dim=-1)  # first maximum = lowest path index
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    accept_length = lengths[rows, best_path]
    next_token = target_tokens[rows, best_path, accept_length]
    return best_path, accept_length, next_token


def check_posterior(posterior_threshold: float, posterior_alpha: float) -> None:
    """The one range check of typical acceptance's epsilon (``posterior_threshold``, in (0, 1]) and delta
    (``posterior_alpha``, > 0 and finite), Medusa paper Sec. 2.3.1; ``ValueError`` naming the setting otherwise."""
    for name, value, upper, bound in (
        ("posterior_threshold", posterior_threshold, 1.0, "(0, 1]"),
        ("posterior_alpha", posterior_alpha, math.inf, "> 0 and finite"),
    ):
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not math.isfinite(value) or not 0 < value <= upper:
            raise ValueError(f"{name} must be {bound}, got {value!r}")


def typical_accept(
    candidates: Tensor,
    target_logits_at_paths: Tensor,
    valid: Tensor,
    temperature: float,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1). LOSSY: output does not follow the target.

    With p the target distribution at ``temperature`` at the position before drafted token x, x is accepted when
    ``p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))`` (epsilon and delta in the paper; H the
    entropy in nats). Each path keeps its longest accepted prefix; the longest path wins, ties going to the
    highest log-likelihood of the accepted tokens, then to the lowest path index. At temperature 0 this is
    :func:`greedy_accept`. Defaults for epsilon and delta belong to the decoder config, not here.

    Args:
        candidates, target_logits_at_paths, valid: as :func:`greedy_accept`.
        temperature: >= 0.
        posterior_threshold: epsilon, in (0, 1].
        posterior_alpha: delta, > 0.
        generator: for the next token.

    Returns:
        ``(best_path, accept_length, next_token)``, each long [B]; ``next_token`` is sampled from p at the last
        accepted position of the best path.

    Raises:
        ValueError: bad shapes, temperature < 0, or epsilon/delta out of range (the message names
            ``posterior_threshold`` or ``posterior_alpha``).
    """
    check_posterior(posterior_threshold, posterior_alpha)
    _check_path_inputs(candidates, target_logits_at_paths, valid)
    if is_greedy(temperature):
        return greedy_accept(candidates, target_logits_at_paths, valid)

    probs = logits_to_probs(target_logits_at_paths, temperature)  # [B, P, D+1, V]
    drafted = torch.where(valid[:, 1:], candidates[..., 1:], 0)  # [B, P, D], padding -> any in-range id
    draft_p = probs[..., :-1, :].gather(-1, drafted.unsqueeze(-1)).squeeze(-1)  # [B, P, D]
    entropy = torch.special.entr(probs[..., :-1, :]).sum(dim=-1)  # [B, P, D], nats
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    accepted = _accepted_prefix((draft_p > threshold) & valid[:, 1:])  # [B, P, D]
    lengths = accepted.sum(dim=-1)  # [B, P]
    log_likelihood = torch.where(accepted, torch.log(draft_p), 0.0).sum(dim=-1)  # [B, P]
    longest = lengths == lengths.max(dim=-1, keepdim=True).values
    best_path = torch.where(longest, log_likelihood, -math.inf).argmax(dim=-1)
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    accept_length = lengths[rows, best_path]
    next_probs = probs[rows, best_path, accept_length]  # [B, V]
    next_token = torch.multinomial(next_probs, 1, generator=generator).squeeze(-1)
    return best_path, accept_length, next_token


def _acceptance_probability(p_x: Tensor, q_x: Tensor | None) -> Tensor:
    """min(1, p(x) / q(x)), [B] -> [B]; p(x) when the draft is a point mass (``q_x`` None).

    q(x) = 0 (a token the draft could not have produced) is accepted iff p(x) > 0, the limit of the ratio.
    """
    if q_x is None:
        return p_x
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), (p_x > 0).to(p_x.dtype))
    return ratio.clamp(max=1.0)


def _residual(p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
    """Target left after rejecting x: norm(max(0, p - q)), or p with x zeroed for a point-mass draft.

    p, q: [B, V]; x: long [B]. Rows with no mass left (p <= q everywhere, a rejection of probability 0 that
    only rounding can produce) keep p.
    """
    left = p.scatter(-1, x.unsqueeze(-1), 0.0) if q is None else (p - q).clamp_min(0.0)
    mass = left.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, left / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def _check_tree_inputs(
    tree: TreeBuffers, node_tokens: Tensor, target_probs: Tensor, draft_probs: Tensor | None
) -> None:
    n = tree.num_nodes
    if node_tokens.ndim != 2 or node_tokens.shape[1] != n or node_tokens.dtype != torch.long:
        raise ValueError(f"node_tokens must be long [B, N={n}], got {node_tokens.dtype} {tuple(node_tokens.shape)}")
    b = node_tokens.shape[0]
    if target_probs.ndim != 3 or target_probs.shape[:2] != (b, n) or not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be float [B={b}, N={n}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and (draft_probs.shape != target_probs.shape or not draft_probs.is_floating_point()):
        raise ValueError(
            f"draft_probs must be None or float of target_probs' shape {tuple(target_probs.shape)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    vocab = target_probs.shape[2]
    if node_tokens.numel() and (int(node_tokens.min()) < 0 or int(node_tokens.max()) >= vocab):
        raise ValueError(f"node_tokens must lie in [0, V={vocab}); got ids outside it")


def tree_speculative_sample_batch(
    tree: TreeBuffers,
    node_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless tree speculative sampling (SpecInfer, Miao et al. 2024; EAGLE, Li et al. 2024, Sec. 3.3).

    Walk from the root. At the current node with target distribution p, try its children in rank order: child
    with token x and draft distribution q is accepted with probability min(1, p(x) / q(x)); on rejection
    p <- norm(max(0, p - q)) and the next sibling is tried. An accepted child becomes the current node, with p
    its own target distribution. When no child is accepted (or there is none), the next token is sampled from
    p: a recovered token after rejections, a bonus token at a leaf. The emitted tokens follow the target
    distribution exactly, provided each node's token was drawn from its ``draft_probs`` row independently of
    its siblings (with replacement), or, with ``draft_probs=None``, chosen deterministically (e.g. Medusa's
    top-k): each candidate is then a point mass, accepted with probability p(x), and on rejection p(x) is set
    to 0 and p renormalised. Do not pass the head distribution for deterministic top-k candidates: that is not
    lossless.

    Args:
        tree: the tree the candidates fill.
        node_tokens: long [B, N], each node's token (the root's is not used).
        target_probs: float [B, N, V]; row n is the target distribution for the token after node n (given the
            path to n). Rows must sum to 1 (see :func:`medusa_train.tree.sampling.logits_to_probs`).
        draft_probs: float [B, N, V] or None; row n is the distribution node n's token was drawn from (for
            Medusa, head ``depth(n) - 1``'s distribution, shared by siblings). Row 0 is not used.
        generator: seeded generator on ``node_tokens``' device, for reproducible draws.

    Returns:
        ``(accepted_nodes, accept_length, next_token)``: long [B, D], the accepted node indices from depth 1 on,
        padded with -1; long [B], how many were accepted; long [B], the recovered or bonus token.

    Raises:
        ValueError: shapes or dtypes do not match the above, or a token id is outside [0, V).
    """
    _check_tree_inputs(tree, node_tokens, target_probs, draft_probs)
    device = node_tokens.device
    dtype = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
    target_probs = target_probs.to(dtype)
    draft_probs = None if draft_probs is None else draft_probs.to(dtype)
    children = tree.children.to(device)  # [N, C]
    batch = node_tokens.shape[0]
    rows = torch.arange(batch, device=device)

    current = torch.zeros(batch, dtype=torch.long, device=device)  # node each row stands on
    p = target_probs[:, 0]  # [B, V], residual target at the current node
    walking = torch.ones(batch, dtype=torch.bool, device=device)  # rows still descending
    accepted_nodes = torch.full((batch, tree.max_depth), -1, dtype=torch.long, device=device)
    accept_length = torch.zeros(batch, dtype=torch.long, device=device)
    for depth in range(tree.max_depth):
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for rank in range(tree.max_children):
            child = children[current, rank]  # [B], -1 when there is no such child
            trying = walking & ~moved & (child >= 0)
            if not bool(trying.any()):
                break
            child = child.clamp(min=0)
            x = node_tokens[rows, child]  # [B]
            q = None if draft_probs is None else draft_probs[rows, child]  # [B, V]
            p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            q_x = None if q is None else q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            u = torch.rand(batch, generator=generator, device=device, dtype=dtype)
            accept = trying & (u < _acceptance_probability(p_x, q_x))
            reject = trying & ~accept
            p = torch.where(reject.unsqueeze(-1), _residual(p, q, x), p)
            current = torch.where(accept, child, current)
            moved |= accept
        accepted_nodes[:, depth] = torch.where(moved, current, -1)
        accept_length += moved.to(torch.long)
        p = torch.where(moved.unsqueeze(-1), target_probs[rows, current], p)
        walking &= moved
        if not bool(walking.any()):
            break
    next_token = torch.multinomial(p, 1, generator=generator).squeeze(-1)
    return accepted_nodes, accept_length, next_token


def tree_speculative_sample(
    tree: TreeBuffers,
    node_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int]:
    """One row of :func:`tree_speculative_sample_batch`.

    Args:
        node_tokens: long [N]; target_probs: float [N, V]; draft_probs: float [N, V] or None.

    Returns:
        ``(accepted_nodes, next_token)``: long [A] node indices accepted below the root (A = accept length),
        and the recovered or bonus token.

    Raises:
        ValueError: as the batched function.
    """
    accepted, length, next_token = tree_speculative_sample_batch(
        tree,
        node_tokens.unsqueeze(0),
        target_probs.unsqueeze(0),
        None if draft_probs is None else draft_probs.unsqueeze(0),
        generator,
    )
    return accepted[0, : int(length[0])], int(next_token[0])


@lru_cache(maxsize=32)
def _chain_tree(length: int) -> TreeBuffers:
    return build_tree_buffers(chain_choices(length), num_heads=length, topk=1)


def chain_speculative_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling of a drafted chain (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Alg. 2).

    Drafted token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
    recovered token is sampled from norm(max(0, p_i - q_i)); if all K are accepted the bonus token is sampled
    from p_K. Runs :func:`tree_speculative_sample` on the chain tree.

    Args:
        draft_tokens: long [K], K >= 0 (K = 0 just samples from ``target_probs[0]``).
        draft_probs: float [K, V], the distribution each drafted token was sampled from; None for greedy
            (deterministic) drafts, treated as point masses.
        target_probs: float [K+1, V]; row i is the target distribution for the token after i drafted tokens.
        generator: seeded generator on the tensors' device.

    Returns:
        ``(accept_length, next_token)``: the accepted tokens are ``draft_tokens[:accept_length]``.

    Raises:
        ValueError: shapes do not match the above, or a token id is outside [0, V).
    """
    if draft_tokens.ndim != 1 or target_probs.ndim != 2 or target_probs.shape[0] != draft_tokens.shape[0] + 1:
        raise ValueError(
            f"draft_tokens must be [K] and target_probs [K+1, V]; got {tuple(draft_tokens.shape)} and "
            f"{tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (draft_tokens.shape[0], target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be None or [K, V] = [{draft_tokens.shape[0]}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    k = draft_tokens.shape[0]
    if k == 0:
        return 0, int(torch.multinomial(target_probs[0].float(), 1, generator=generator))
    tree = _chain_tree(k)
    node_tokens = torch.cat([draft_tokens.new_zeros(1), draft_tokens])  # root token unused
    if draft_probs is not None:
        draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[1]), draft_probs])
    accepted, next_token = tree_speculative_sample(tree, node_tokens, target_probs, draft_probs, generator)
    return int(accepted.numel()), next_token
