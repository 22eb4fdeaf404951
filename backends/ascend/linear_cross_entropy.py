"""ascend backend: linear_cross_entropy (SPEC 2.9) -> kernels_ascend.linear_cross_entropy (no fused operator).

Sequence-chunked like the reference: per chunk of rows the kernels compute the chunk's logits
(h @ W^T, fp32), each row's logsumexp and target logit; the backward recomputes a chunk's logits, turns
them in place into (softmax - onehot) * dL/dloss / count, and accumulates dh = dL @ W and
dW += dL^T @ h with the same strided matmul kernel. Peak extra memory is one [rows, V] fp32 chunk.
The mean over counted rows is a torch sum of per-row losses (NaN with no counted row, as torch). The
chunking and the declared backward (from the forward's saved lse) are backends/linear_ce.py's.
Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
"""

from __future__ import annotations

import functools

import torch

from backends import linear_ce
from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.linear_ce import LinearCEKernels, row_chunks

# rows per chunk keep one chunk's fp32 logits under this many elements (the reference uses 2^24)
CHUNK_ELEMS = 1 << 22


def _forward(h, weight, targets, ignore_index):
    from kernels_ascend.linear_cross_entropy import matmul, row_softmax

    counted = targets != ignore_index  # [n]
    logits = torch.empty((h.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    matmul(h, weight.T, logits)  # [n, V]
    lse, t_logit = row_softmax(logits, torch.where(counted, targets, 0))
    return lse, (lse - t_logit)[counted].sum()


def _backward(h, weight, targets, ignore_index, lse, scale):
    from kernels_ascend.linear_cross_entropy import matmul, row_softmax

    counted = targets != ignore_index
    logits = torch.empty((h.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    matmul(h, weight.T, logits)
    row_scale = (counted.float() * scale).contiguous()
    row_softmax(logits, torch.where(counted, targets, 0), row_scale)  # logits -> dL/dlogits in place
    matmul(logits, weight, grad_h)
    matmul(logits.T, h, grad_w, accumulate=True)
    return grad_h, grad_w


_KERNELS = LinearCEKernels(row_chunks(CHUNK_ELEMS), _forward, _backward)


def impl(provider: OpsProvider) -> OpImpl:
    def linear_cross_entropy(h, weight, targets, ignore_index=-100):
        provider.record("linear_cross_entropy", provider.kernel_label("linear_cross_entropy"))
        return linear_ce.forward(_KERNELS, h, weight, targets, ignore_index)

    backward = functools.partial(linear_ce.backward, _KERNELS)
    return OpImpl(linear_cross_entropy, OpCaps(FLOATS, differentiable=True), backward=backward)
