"""`ChunkedLinearCrossEntropy`: the chunked linear cross-entropy as a torch.autograd.Function, for a loss
that is not a backend op: glm5/parallel/vocab.py's vocabulary-parallel loss, whose per-chunk kernels talk
to a process group. No backend uses it: a backend's ops are differentiated only by their declared
`OpImpl.backward` (backends/library.py). The chunking and the gradient routing are backends/linear_ce.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from backends import linear_ce
from backends.linear_ce import LinearCEKernels, row_chunks

__all__ = ["ChunkedLinearCrossEntropy", "LinearCEKernels", "row_chunks"]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight^T in row chunks, differentiable in h and weight (SPEC 2.9).

    Use: `ChunkedLinearCrossEntropy.apply(h, weight, targets, ignore_index, kernels)`.
    """

    @staticmethod
    def forward(ctx: Any, h, weight, targets, ignore_index: int, kernels: LinearCEKernels):
        loss, lse = linear_ce.forward(kernels, h, weight, targets, ignore_index)
        ctx.save_for_backward(h, weight, targets, loss, lse)
        ctx.ignore_index, ctx.kernels = ignore_index, kernels
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        h, weight, targets, loss, lse = ctx.saved_tensors
        args = dict(h=h, weight=weight, targets=targets, ignore_index=ctx.ignore_index)
        grad_h, grad_w = linear_ce.backward(ctx.kernels, args, (loss, lse), (grad_loss, None))
        return grad_h, grad_w, None, None, None
