"""cpu backend: w8a8_matmul (SPEC 2.6): exact integer GEMM (`_intmm`: VNNI `torch._int_mm` or fp64),
then the reference's fp32 epilogue in its order, so the output is bitwise the reference's.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._intmm import PATH, int_matmul


def epilogue(acc, x_scale, w_scale, bias, out_dtype) -> torch.Tensor:
    out = acc.float()  # exact integers -> fp32, rounded once (as the reference's int64 -> fp32)
    out.mul_(x_scale[:, None]).mul_(w_scale[None, :])
    if bias is not None:
        out.add_(bias.float()[None, :])
    return out.to(out_dtype)


def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q int8 [M, K], x_scale f32 [M], w_q int8 [N, K], w_scale f32 [N] -> [M, N] out_dtype.
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
    """
    return epilogue(int_matmul(x_q, w_q), x_scale, w_scale, bias, out_dtype)


IMPL = OpImpl(
    w8a8_matmul,
    OpCaps(FLOATS, notes={"integer_gemm": PATH}, run_to_run=True, batch_invariant=True),
)
