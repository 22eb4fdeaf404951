"""cpu backend: w4a8_matmul (SPEC 2.7): int4 unpacked to int8 once per call, one exact integer GEMM per
group (`_intmm`), the fp32 group sum in group order as the reference, so the output is bitwise its.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._intmm import PATH, int_matmul
from backends.formats import unpack_int4


def grouped_sum(x_q: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """sum_g float32(acc_g) * w_scale[:, g] in group order, fp32 [M, N] (before the x_scale product)."""
    total = torch.zeros(x_q.shape[0], w.shape[0], dtype=torch.float32)
    for g in range(x_q.shape[1] // group_size):
        cols = slice(g * group_size, (g + 1) * group_size)
        part = int_matmul(x_q[:, cols], w[:, cols].contiguous()).float()
        total.add_(part.mul_(w_scale[None, :, g]))
    return total


def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q int8 [M, K], w_packed uint8 [N, K//2], w_scale f32 [N, K // group_size] -> [M, N] out_dtype.
    Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
    """
    out = grouped_sum(x_q, unpack_int4(w_packed), w_scale, group_size)
    out = x_scale[:, None] * out
    if bias is not None:
        out.add_(bias.float()[None, :])
    return out.to(out_dtype)


IMPL = OpImpl(
    w4a8_matmul,
    OpCaps(FLOATS, notes={"integer_gemm": PATH}, run_to_run=True, batch_invariant=True),
)
