"""cpu backend: linear_cross_entropy (SPEC 2.9): chunked forward keeping only the per-row logsumexp, and a
backward that recomputes each chunk's logits and turns them into the softmax gradient in place, so the
[N, V] logits never exist at once. fp32 throughout (weight cast once per call).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.ops import FLOATS

# Rows per chunk: one chunk's fp32 logits stay under this many elements (16 MiB).
CHUNK_ELEMS = 1 << 22


def _chunks(n: int, v: int):
    step = max(1, CHUNK_ELEMS // max(1, v))
    for a in range(0, n, step):
        yield slice(a, min(a + step, n))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index):
        wf = weight.float()
        counted = targets != ignore_index
        tgt = torch.where(counted, targets, 0).long()
        lse = torch.empty(h.shape[0])
        total = torch.zeros((), dtype=torch.float32)
        for r in _chunks(h.shape[0], weight.shape[0]):
            logits = h[r].float() @ wf.T
            lse[r] = torch.logsumexp(logits, dim=-1)
            nll = lse[r] - logits.gather(1, tgt[r, None])[:, 0]
            total += nll.masked_fill_(~counted[r], 0).sum()
        ctx.save_for_backward(h, weight, tgt, counted, lse)
        return total / counted.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, tgt, counted, lse = ctx.saved_tensors
        wf = weight.float()
        count = int(counted.sum())
        grad_h = torch.zeros(h.shape, dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32)
        if count:
            scale = grad_loss.float() / count
            for r in _chunks(h.shape[0], weight.shape[0]):
                hf = h[r].float()
                p = torch.mm(hf, wf.T).sub_(lse[r, None]).exp_()
                p[torch.arange(p.shape[0]), tgt[r]] -= 1.0
                p.mul_(counted[r, None] * scale)
                grad_h[r] = p @ wf
                grad_w.addmm_(p.T, hf)
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None, None


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """h: [N, D] float; weight: [V, D] float; targets: int [N]. Returns a float32 scalar, differentiable
    in h and weight; NaN with no counted target. Semantics: backends/reference/linear_cross_entropy.py
    """
    return _LinearCrossEntropy.apply(h, weight, targets, ignore_index)


IMPL = OpImpl(
    linear_cross_entropy,
    OpCaps(FLOATS, run_to_run=True, batch_invariant=True, differentiable=True),
)
