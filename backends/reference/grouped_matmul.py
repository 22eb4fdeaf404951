"""MoE grouped GEMM over expert-sorted rows (SPEC 2.8).

    out[group_offsets[e] : group_offsets[e+1]] = x[same rows] @ w[e]^T     for every expert e

Each row depends only on itself and its expert's weight, so token order inside an expert and empty
experts change nothing. Quantized variants are the per-row W8A8 / W4A8 GEMMs of SPEC 2.6 / 2.7.

The float variant is differentiable in x and w (`backward`): with dy the output gradient,

    dx[rows of e] = dy[rows of e] @ w[e]        dw[e] = dy[rows of e]^T @ x[rows of e]

(an expert with no rows gets a zero dw[e]; rows outside every expert a zero dx). The quantized
variants are not differentiable (their integer x and w carry no gradient).
"""

from __future__ import annotations

import torch

from backends import invariant
from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS
from backends.reference.w4a8_matmul import w4a8_matmul
from backends.reference.w8a8_matmul import w8a8_matmul


@reference_op("grouped_matmul")
def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    m, n = x.shape[0], w.shape[1]  # x: [M, K], w: [E, N, K(/2)]
    out_dtype = out_dtype or x.dtype
    out = torch.zeros(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        r = slice(offs[e], offs[e + 1])
        if offs[e] == offs[e + 1]:
            continue
        if x.dtype.is_floating_point and invariant.active():
            out[r] = invariant.exact_matmul(x[r], w[e].T, out_dtype)
        elif x.dtype.is_floating_point:
            # fp64 so that a row does not depend on how many rows share its expert (an fp32 BLAS GEMM
            # blocks by M, which changes the low bits: the contract says token order changes no row)
            out[r] = (x[r].double() @ w[e].double().T).to(out_dtype)
        elif w.dtype == torch.int8:
            out[r] = w8a8_matmul(x[r], x_scale[r], w[e], w_scale[e], out_dtype=out_dtype)
        else:
            out[r] = w4a8_matmul(x[r], x_scale[r], w[e], w_scale[e], group_size, out_dtype=out_dtype)
    return out


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) like (x, w) of the float variant from the output gradient (no saved output); fp64 sums,
    as the forward's."""
    x, w, offs = args["x"], args["w"], args["group_offsets"].tolist()
    (grad,) = grad_outputs
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for e in range(w.shape[0]):
        r = slice(offs[e], offs[e + 1])
        if offs[e] == offs[e + 1]:
            continue
        dy = grad[r].double()
        dx[r] = dy @ w[e].double()
        dw[e] = dy.T @ x[r].double()
    return dx.to(x.dtype), dw.to(w.dtype)


IMPL = OpImpl(
    grouped_matmul,
    OpCaps(FLOATS + ("w8a8", "w4a8"), differentiable=True, layout_invariant=True),
    backward=backward,
)
