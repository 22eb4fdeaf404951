"""Linear + cross-entropy on a vocabulary split over a group (SPEC 2.9 on a sharded `lm_head`).

Rank r holds rows [vocab_start, vocab_start + V/tp) of the output weight and the whole (replicated) h.
Each rank calls its backend's `linear_cross_entropy_shard` (SPEC 2.9.1) for its shard's per-row max, sum
of exponentials and (where it owns the target) target logit, the statistics Megatron's vocab-parallel
cross-entropy keeps; the op runs in row chunks and its declared backward recomputes each chunk's logits,
so neither the [N, V] nor the [N, V/tp] fp32 logits exist at once. One all-gather of those statistics
gives every rank the same global log-sum-exp, combined in rank order, so every rank gets the same loss
bits. The combination is plain autograd over [N] vectors: this rank's own statistics are the
differentiable ones, the other ranks' enter as constants, so the gradient reaching the op is this rank's
part (the max is a shift and carries none, as the op declares), which `enter(h, group)` sums over the
group for h.

The layout-invariant mode (SPEC 12) refuses this fused loss: its log-sum-exp over the split vocabulary is
not the unsplit vocabulary's fixed tree. Log-probs in the mode come from the gathered logits instead.
"""

from __future__ import annotations

import torch

from backends.interface import Backend
from backends.invariant import engine as invariant
from glm5.parallel.group import Group
from glm5.parallel.invariant import FUSED_LOSS


def vocab_parallel_linear_cross_entropy(
    h: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    vocab_start: int,
    backend: Backend,
    ignore_index: int = -100,
) -> torch.Tensor:
    """h [N, D] (the same on every rank), weight_shard [V/tp, D] (vocabulary rows from `vocab_start`),
    targets [N] (global ids) -> the fp32 mean cross-entropy over the counted rows, the same bits on every
    rank and equal to `linear_cross_entropy(h, full_weight, targets)` up to rounding. The shard's
    statistics come from `backend.linear_cross_entropy_shard`.

    Differentiable in h and weight_shard. The gradient of h is this rank's part (its vocabulary rows'
    contribution): pass `enter(h, group)` to have it summed over the group, as `VocabParallelHead.loss`
    does. No counted target: NaN loss and zero gradients (as the reference); a counted target that no
    rank holds (outside the vocabulary) makes the loss NaN rather than costing a host read to raise.
    """
    if h.dim() != 2 or weight_shard.dim() != 2 or h.shape[1] != weight_shard.shape[1]:
        raise ValueError(
            "h, weight_shard: expected [N, D] and [V/tp, D], "
            f"got {tuple(h.shape)} and {tuple(weight_shard.shape)}"
        )
    if targets.shape != h.shape[:1]:
        raise ValueError(f"targets: expected [N={h.shape[0]}], got {tuple(targets.shape)}")
    if invariant.active():
        # its per-rank sums of exponentials, combined in rank order, are not the unsplit vocabulary's tree
        raise invariant.NotLayoutInvariant(f"vocabulary-split {FUSED_LOSS}")
    m, s, tl = backend.linear_cross_entropy_shard(h, weight_shard, targets, vocab_start, ignore_index)
    rel = targets.long() - vocab_start
    mine = (targets != ignore_index) & (rel >= 0) & (rel < weight_shard.shape[0])
    local = torch.stack([m.detach(), s.detach(), tl.detach(), mine.float()])
    stats = group.all_gather(local[None], dim=0)  # [tp, 4, N], constants
    # every rank combines the same gathered bits in rank order (its own row: the same bits, with autograd)
    mine_r = group.rank
    top = stats[:, 0].amax(dim=0)
    total = target_logit = owners = None
    for r in range(stats.shape[0]):
        s_r, t_r = (s, tl) if r == mine_r else (stats[r, 1], stats[r, 2])
        part = s_r * torch.exp(stats[r, 0] - top)
        total = part if total is None else total + part
        target_logit = t_r if target_logit is None else target_logit + t_r  # one owner: the others add 0
        owners = stats[r, 3] if owners is None else owners + stats[r, 3]
    lse = top + torch.log(total)
    counted = targets != ignore_index
    nll = torch.where(owners > 0, lse - target_logit, torch.nan)
    return torch.where(counted, nll, 0.0).sum() / counted.sum()
