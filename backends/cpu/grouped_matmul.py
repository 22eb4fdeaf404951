"""cpu backend: grouped_matmul (SPEC 2.8): one GEMM per non-empty expert over its row range.

Float variants accumulate in fp32 (bf16/fp16 through oneDNN's fp32-accumulating GEMM); a row's result
can then depend on how many rows share its expert (BLAS blocks by M), so batch invariance is not claimed
for them (the reference pays fp64 for it). Quantized variants are the exact W8A8 / W4A8 paths, bitwise
the reference's and batch invariant. The float variant is differentiable in x and w (`backward`: one
GEMM pair per non-empty expert, accumulated as the forward's).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._intmm import PATH, int_matmul
from backends.cpu.w4a8_matmul import grouped_sum
from backends.cpu.w8a8_matmul import epilogue
from backends.formats import unpack_int4
from backends.invariant import engine as invariant


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows group_offsets[e]:group_offsets[e+1] of x times w[e]^T, for every expert e.
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
    """
    m, n = x.shape[0], w.shape[1]
    out_dtype = out_dtype or x.dtype
    out = torch.empty(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    if offs[-1] < m:
        out[offs[-1] :].zero_()
    if offs[0] > 0:
        out[: offs[0]].zero_()
    w4 = unpack_int4(w) if w.dtype == torch.uint8 else None
    for e in range(w.shape[0]):
        a, z = offs[e], offs[e + 1]
        if a == z:
            continue
        if x.dtype.is_floating_point and invariant.active():  # SPEC 12: exact, any row count
            out[a:z] = invariant.exact_matmul(x[a:z], w[e].T, out_dtype, weight=True)
        elif x.dtype.is_floating_point:
            if x.dtype == w.dtype == out_dtype and x.dtype != torch.float32:
                out[a:z] = torch.mm(x[a:z], w[e].T).to(out_dtype)
            else:
                out[a:z] = torch.mm(x[a:z].float(), w[e].float().T).to(out_dtype)
        elif w4 is None:
            out[a:z] = epilogue(int_matmul(x[a:z], w[e]), x_scale[a:z], w_scale[e], None, out_dtype)
        else:
            acc = grouped_sum(x[a:z], w4[e], w_scale[e], group_size)
            out[a:z] = (x_scale[a:z, None] * acc).to(out_dtype)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b in dtype, accumulated as the forward's GEMMs (oneDNN fp32 accumulation for bf16/fp16)."""
    if a.dtype == b.dtype == dtype and dtype != torch.float32:
        return torch.mm(a, b)
    return torch.mm(a.float(), b.float()).to(dtype)


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the float variant: dx[rows of e] = dy @ w[e], dw[e] = dy^T @ x[rows of e] (zero for
    an expert with no rows). Semantics: backends/reference/grouped_matmul.py"""
    x, w, offs = args["x"], args["w"], args["group_offsets"].tolist()
    (grad,) = grad_outputs
    dx = torch.zeros_like(x, memory_format=torch.contiguous_format)
    dw = torch.zeros_like(w, memory_format=torch.contiguous_format)
    for e in range(w.shape[0]):
        a, z = offs[e], offs[e + 1]
        if a == z:
            continue
        dx[a:z] = _mm(grad[a:z], w[e], x.dtype)
        dw[e] = _mm(grad[a:z].T, x[a:z], w.dtype)
    return dx, dw


IMPL = OpImpl(
    grouped_matmul,
    OpCaps(
        FLOATS + ("w8a8", "w4a8"),
        notes={
            "integer_gemm": PATH,
            "batch_invariant": "quantized variants only: float GEMMs block by the rows of each expert",
        },
        run_to_run=True,
        batch_invariant=False,
        differentiable=True,
        layout_invariant=True,
    ),
    backward=backward,
)
