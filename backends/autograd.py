"""Autograd wrappers shared by every backend (STYLE rule 2: written once, here, not per kernel package).

A backend hands its own forward and backward kernels to these `torch.autograd.Function`s; the wrappers
only save what the backward needs and route gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from backends.layout import SeqLayout

#: (q, kv_cache, indices, layout, sm_scale, d_v) -> (out, lse)
SparseMLAForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: (q, kv_cache, indices, layout, sm_scale, d_v, out, lse, d_out, d_lse or None) -> (dq, dkv)
SparseMLABackward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class SparseMLAFunction(torch.autograd.Function):
    """Sparse MLA attention (SPEC 2.4) differentiable in q and kv_cache; `indices` and `layout` are not.

    Use: `SparseMLAFunction.apply(q, kv_cache, indices, layout, sm_scale, d_v, forward, backward)`.
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        layout: SeqLayout,
        sm_scale: float,
        d_v: int,
        forward: SparseMLAForward,
        backward: SparseMLABackward,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = forward(q, kv_cache, indices, layout, sm_scale, d_v)
        ctx.save_for_backward(q, kv_cache, indices, out, lse)
        ctx.layout, ctx.sm_scale, ctx.d_v, ctx.backward_fn = layout, sm_scale, d_v, backward
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None):
        q, kv_cache, indices, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dkv = ctx.backward_fn(
            q, kv_cache, indices, ctx.layout, ctx.sm_scale, ctx.d_v, out, lse, d_out, d_lse
        )
        return (
            dq if ctx.needs_input_grad[0] else None,
            dkv if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


@dataclass(frozen=True)
class LinearCEKernels:
    """A backend's per-chunk work for `ChunkedLinearCrossEntropy` (SPEC 2.9).

    chunks(n, v) -> row slices, each small enough that one chunk's fp32 logits [rows, V] fit the budget;
    cast(h, weight) -> (h, weight) once per call (e.g. a dtype promotion), before any chunk;
    forward(h_r, weight, targets_r, ignore_index) -> (lse_r fp32 [rows], sum of the counted rows' nll);
    backward(h_r, weight, targets_r, ignore_index, lse_r, scale) -> (d h_r, d weight from these rows), with
      scale = dL/dloss / max(count, 1) and ignored rows contributing nothing.
    """

    chunks: Callable[[int, int], Iterable[slice]]
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    cast: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight^T in row chunks, differentiable in h and weight (SPEC 2.9): the
    forward keeps only each row's logsumexp, the backward recomputes each chunk's logits, so [N, V]
    never exists. No counted target: NaN loss (as torch) and zero gradients, with no host read.

    Use: `ChunkedLinearCrossEntropy.apply(h, weight, targets, ignore_index, kernels)`.
    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """

    @staticmethod
    def forward(ctx: Any, h, weight, targets, ignore_index: int, kernels: LinearCEKernels):
        hc, wc = kernels.cast(h, weight) if kernels.cast else (h, weight)
        n, v = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for r in kernels.chunks(n, v):
            lse[r], part = kernels.forward(hc[r], wc, targets[r], ignore_index)
            total = total + part
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(h, weight, targets, lse, count)
        ctx.ignore_index, ctx.kernels = ignore_index, kernels
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        h, weight, targets, lse, count = ctx.saved_tensors
        k = ctx.kernels
        hc, wc = k.cast(h, weight) if k.cast else (h, weight)
        scale = grad_loss.float() / count.clamp_min(1)
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        for r in k.chunks(h.shape[0], weight.shape[0]):
            dh, dw = k.backward(hc[r], wc, targets[r], ctx.ignore_index, lse[r], scale)
            grad_h[r] = dh
            grad_w += dw
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None, None, None


def row_chunks(chunk_elems: int, multiple: int = 1) -> Callable[[int, int], Iterable[slice]]:
    """Row slices whose fp32 logits [rows, V] stay under chunk_elems elements (rows a multiple of
    `multiple` when a chunk holds more than that)."""

    def chunks(n: int, v: int) -> Iterable[slice]:
        step = max(1, chunk_elems // max(1, v))
        if step > multiple:
            step -= step % multiple
        return [slice(a, min(a + step, n)) for a in range(0, n, step)]

    return chunks
