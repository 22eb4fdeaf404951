"""Linear + cross-entropy on a vocabulary split over a group (SPEC 2.9 on a sharded `lm_head`).

Rank r holds rows [vocab_start, vocab_start + V/tp) of the output weight and the whole (replicated) h.
Per row chunk each rank computes its shard's logits, their max, sum of exponentials and (where it owns
the target) the target logit; one all-gather of those per-row statistics gives every rank the same global
log-sum-exp, combined in rank order, so every rank gets the same loss bits. The forward keeps only the
per-row global log-sum-exp and the backward recomputes each chunk's logits, so neither the [N, V] nor
the [N, V/tp] fp32 logits exist at once. The chunking and gradient routing are the backends' shared
`backends.linear_ce` (as a torch.autograd.Function here: this loss is not a backend op); only the
per-chunk math below knows about the group.

The local logits are plain torch matmuls in fp32, as the reference backend's per-chunk math: the
backend op `linear_cross_entropy` returns the mean loss and the per-row log-sum-exp of the vocabulary it
is given, not the target logit a split vocabulary has to take from the rank that holds it, and no
backend has a lower-level op for these statistics.

The layout-invariant mode (SPEC 12) refuses this fused loss: its log-sum-exp over the split vocabulary is
not the unsplit vocabulary's fixed tree. Log-probs in the mode come from the gathered logits instead.
"""

from __future__ import annotations

import torch

from backends import linear_ce
from backends.invariant import engine as invariant
from backends.linear_ce import LinearCEKernels, row_chunks
from glm5.parallel.group import Group
from glm5.parallel.invariant import FUSED_LOSS

# Rows per chunk are chosen so one chunk's local fp32 logits stay under this many elements (read at call
# time: tests shrink it to force several chunks). Equal shards give every rank the same chunks, so the
# per-chunk collectives pair up; the plan only makes equal shards.
CHUNK_ELEMS = 1 << 24


def vocab_parallel_linear_cross_entropy(
    h: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """h [N, D] (the same on every rank), weight_shard [V/tp, D] (vocabulary rows from `vocab_start`),
    targets [N] (global ids) -> the fp32 mean cross-entropy over the counted rows, the same bits on every
    rank and equal to `linear_cross_entropy(h, full_weight, targets)` up to rounding.

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
    kernels = _kernels(group, vocab_start)
    return ChunkedLinearCrossEntropy.apply(h, weight_shard, targets, ignore_index, kernels)


def _kernels(group: Group, vocab_start: int) -> LinearCEKernels:
    def owned(targets: torch.Tensor, width: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows whose target is one of this rank's vocabulary rows, their local index (0 elsewhere))."""
        rel = targets.long() - vocab_start
        mine = (targets != ignore_index) & (rel >= 0) & (rel < width)
        return mine, torch.where(mine, rel, 0)

    def forward(h, wf, targets, ignore_index):
        logits = h.float() @ wf.T  # [n, V/tp]
        m = logits.amax(dim=-1)
        s = torch.exp(logits - m[:, None]).sum(dim=-1)
        mine, idx = owned(targets, wf.shape[0], ignore_index)
        tl = torch.where(mine, logits.gather(1, idx[:, None])[:, 0], 0.0)
        stats = group.all_gather(torch.stack([m, s, tl, mine.float()])[None], dim=0)  # [tp, 4, n]
        # every rank combines the same gathered bits in rank order: the same lse bits everywhere
        top = stats[:, 0].amax(dim=0)
        total = stats[0, 1] * torch.exp(stats[0, 0] - top)
        target_logit, owners = stats[0, 2], stats[0, 3]
        for r in range(1, stats.shape[0]):
            total = total + stats[r, 1] * torch.exp(stats[r, 0] - top)
            target_logit = target_logit + stats[r, 2]  # one owner per row: the others add zeros
            owners = owners + stats[r, 3]
        lse = top + torch.log(total)
        counted = targets != ignore_index
        nll = torch.where(owners > 0, lse - target_logit, torch.nan)
        return lse, nll[counted].sum()

    def backward(h, wf, targets, ignore_index, lse, scale):
        counted = targets != ignore_index
        hf = h.float()
        p = torch.exp(hf @ wf.T - lse[:, None])  # this shard's columns of the softmax [n, V/tp]
        mine, idx = owned(targets, wf.shape[0], ignore_index)
        rows = torch.arange(p.shape[0], device=p.device)
        p[rows, idx] -= mine.float()
        p = p * (counted[:, None] * scale)
        return p @ wf, p.T @ hf

    def chunks(n: int, v: int):
        return row_chunks(CHUNK_ELEMS)(n, v)

    return LinearCEKernels(chunks, forward, backward, cast=lambda h, w: (h, w.float()))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight^T in row chunks through `kernels`, differentiable in h and weight:
    `ChunkedLinearCrossEntropy.apply(h, weight, targets, ignore_index, kernels)`."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index: int, kernels: LinearCEKernels):
        loss, lse = linear_ce.forward(kernels, h, weight, targets, ignore_index)
        ctx.save_for_backward(h, weight, targets, loss, lse)
        ctx.ignore_index, ctx.kernels = ignore_index, kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, targets, loss, lse = ctx.saved_tensors
        args = dict(h=h, weight=weight, targets=targets, ignore_index=ctx.ignore_index)
        grad_h, grad_w = linear_ce.backward(ctx.kernels, args, (loss, lse), (grad_loss, None))
        return grad_h, grad_w, None, None, None
