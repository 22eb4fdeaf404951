"""Autograd wrappers shared by every backend (STYLE rule 2: written once, here, not per kernel package).

A backend hands its own forward and backward kernels to these `torch.autograd.Function`s; the wrappers
only save what the backward needs and route gradients.
"""

from __future__ import annotations

from collections.abc import Callable
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
