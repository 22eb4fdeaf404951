"""ascend backend: linear_cross_entropy (SPEC 2.9) -> kernels_ascend.linear_cross_entropy (no fused operator).

Sequence-chunked like the reference: per chunk of rows the kernels compute the chunk's logits
(h @ W^T, fp32), each row's logsumexp and target logit; the backward recomputes a chunk's logits, turns
them in place into (softmax - onehot) * dL/dloss / count, and accumulates dh = dL @ W and
dW += dL^T @ h with the same strided matmul kernel. Peak extra memory is one [rows, V] fp32 chunk.
The mean over counted rows is a torch sum of per-row losses (NaN with no counted row, as torch).
Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
"""

from __future__ import annotations

import torch

from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.ops import FLOATS

# rows per chunk keep one chunk's fp32 logits under this many elements (the reference uses 2^24)
CHUNK_ELEMS = 1 << 22


def _chunks(n: int, v: int):
    step = max(1, CHUNK_ELEMS // max(1, v))
    for a in range(0, n, step):
        yield slice(a, min(a + step, n))


class _LinearCrossEntropy(torch.autograd.Function):
    # TODO(lead): move next to the other shared wrappers in backends/autograd.py (STYLE rule 2)
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index):
        from kernels_ascend.linear_cross_entropy import matmul, row_softmax

        counted = targets != ignore_index  # [N]
        tgt = torch.where(counted, targets, 0)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for r in _chunks(h.shape[0], weight.shape[0]):
            logits = torch.empty((r.stop - r.start, weight.shape[0]), dtype=torch.float32, device=h.device)
            matmul(h[r], weight.T, logits)  # [n, V]
            lse, t_logit = row_softmax(logits, tgt[r])
            total = total + (lse - t_logit)[counted[r]].sum()
        ctx.save_for_backward(h, weight, tgt, counted)
        return total / counted.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        from kernels_ascend.linear_cross_entropy import matmul, row_softmax

        h, weight, tgt, counted = ctx.saved_tensors
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        count = int(counted.sum())
        if count:
            row_scale = counted.float() * (grad_loss.float() / count)
            for r in _chunks(h.shape[0], weight.shape[0]):
                logits = torch.empty(
                    (r.stop - r.start, weight.shape[0]), dtype=torch.float32, device=h.device
                )
                matmul(h[r], weight.T, logits)
                row_softmax(logits, tgt[r], row_scale[r].contiguous())  # logits -> dL/dlogits in place
                matmul(logits, weight, grad_h[r])
                matmul(logits.T, h[r], grad_w, accumulate=True)
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None, None


def impl(provider: OpsProvider) -> OpImpl:
    def linear_cross_entropy(h, weight, targets, ignore_index=-100):
        provider.record("linear_cross_entropy", provider.kernel_label("linear_cross_entropy"))
        return _LinearCrossEntropy.apply(h, weight, targets, ignore_index)

    return OpImpl(linear_cross_entropy, OpCaps(FLOATS, differentiable=True))
