"""Linear + cross-entropy in sequence chunks (SPEC 2.9).

    loss = mean_{i : targets[i] != ignore_index} ( logsumexp_v(h[i] @ W[v]) - h[i] @ W[targets[i]] )

fp32 throughout. The forward keeps only the per-row logsumexp; the backward recomputes each chunk's
logits, so the [N, V] fp32 logits never exist at once. With no counted target the loss is NaN (as
torch.nn.functional.cross_entropy) and the gradients are zero.
`linear_cross_entropy_naive` is the plain definition; tests check the two agree.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS

# Rows per chunk are chosen so one chunk's fp32 logits stay under this many elements.
_CHUNK_ELEMS = 1 << 24


def _chunks(n: int, v: int):
    step = max(1, _CHUNK_ELEMS // max(1, v))
    for a in range(0, n, step):
        yield slice(a, min(a + step, n))


def linear_cross_entropy_naive(h, weight, targets, ignore_index=-100):
    logits = h.float() @ weight.float().T  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=ignore_index)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index):
        wf = weight.float()  # [V, D]
        counted = targets != ignore_index  # [N]
        tgt = torch.where(counted, targets, 0).long()
        lse = torch.empty(h.shape[0])
        total = torch.zeros((), dtype=torch.float32)
        for r in _chunks(h.shape[0], weight.shape[0]):
            logits = h[r].float() @ wf.T  # [n, V]
            lse[r] = torch.logsumexp(logits, dim=-1)
            nll = lse[r] - logits.gather(1, tgt[r, None])[:, 0]
            total = total + nll[counted[r]].sum()
        count = counted.sum()
        ctx.save_for_backward(h, weight, tgt, counted, lse)
        return total / count

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
                p = torch.exp(hf @ wf.T - lse[r, None])  # softmax [n, V]
                p[torch.arange(p.shape[0]), tgt[r]] -= 1.0
                p = p * (counted[r, None] * scale)
                grad_h[r] = p @ wf
                grad_w += p.T @ hf
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None, None


@reference_op("linear_cross_entropy")
def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    return _ChunkedLinearCrossEntropy.apply(h, weight, targets, ignore_index)


IMPL = OpImpl(linear_cross_entropy, OpCaps(FLOATS, differentiable=True))
