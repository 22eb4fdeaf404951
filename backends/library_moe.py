"""grouped_matmul (SPEC 2.8) as the torch custom op `torch.ops.glm5.grouped_matmul`, registered as
backends/library.py registers the others (which lists it in `CUSTOM_OPS`), with its autograd: the float
variant's `grouped_matmul_backward` runs the backend's declared backward (`OpImpl.backward`) on the saved
x, w and offsets (no saved output), so the routed experts train with each forward run once.

Semantics: backends/reference/grouped_matmul.py (docs/spec.md 2.8).
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.custom_op import _lib_op, _run, run_backward


@_lib_op("grouped_matmul")
def grouped_matmul(
    x: Tensor,
    w: Tensor,
    group_offsets: Tensor,
    x_scale: Tensor | None,
    w_scale: Tensor | None,
    group_size: int | None,
    out_dtype: torch.dtype | None,
    backend: str,
) -> Tensor:
    args = dict(
        x=x,
        w=w,
        group_offsets=group_offsets,
        x_scale=x_scale,
        w_scale=w_scale,
        group_size=group_size,
        out_dtype=out_dtype,
    )
    return _run(backend, "grouped_matmul", args)


@grouped_matmul.register_fake
def _(x, w, group_offsets, x_scale, w_scale, group_size, out_dtype, backend):
    dtype = out_dtype if out_dtype is not None else x.dtype
    return x.new_empty((x.shape[0], w.shape[1]), dtype=dtype)


@_lib_op("grouped_matmul_backward")
def grouped_matmul_backward(
    grad: Tensor,
    x: Tensor,
    w: Tensor,
    group_offsets: Tensor,
    out_dtype: torch.dtype | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """(dx, dw) of the float variant (the only differentiable one: integer tensors carry no gradient)."""
    args = dict(
        x=x,
        w=w,
        group_offsets=group_offsets,
        x_scale=None,
        w_scale=None,
        group_size=None,
        out_dtype=out_dtype,
    )
    return run_backward(backend, "grouped_matmul", args, (None,), (grad,))


@grouped_matmul_backward.register_fake
def _(grad, x, w, group_offsets, out_dtype, backend):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_setup(ctx, inputs, output):
    x, w, group_offsets, _x_scale, _w_scale, _group_size, out_dtype, backend = inputs
    ctx.save_for_backward(x, w, group_offsets)
    ctx.scalars = (out_dtype, backend)


def _grouped_bwd(ctx, grad):
    dx, dw = grouped_matmul_backward(grad, *ctx.saved_tensors, *ctx.scalars)
    return (dx, dw) + (None,) * 6


grouped_matmul.register_autograd(_grouped_bwd, setup_context=_grouped_setup)
