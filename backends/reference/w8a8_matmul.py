"""W8A8 GEMM (SPEC 2.6).

    acc[m, n] = sum_k int32(x_q[m, k]) * int32(w_q[n, k])            exact
    out[m, n] = (float32(acc) * x_scale[m] * w_scale[n] + bias[n]).to(out_dtype)

The integer part is an fp64 matmul of integer-valued tensors: exact (|acc| <= 127*128*K < 2^53)
and far faster on CPUs without VNNI than torch._int_mm.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS


def int_matmul_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] x b [N, K]^T of integer tensors -> exact int64 [M, N]."""
    return (a.double() @ b.double().T).to(torch.int64)


def scale_epilogue(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = acc.float() * x_scale[:, None] * w_scale[None, :]  # fp32, in this order
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


@reference_op("w8a8_matmul")
def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    acc = int_matmul_exact(x_q, w_q)  # [M, N], exact
    return scale_epilogue(acc, x_scale, w_scale, bias, out_dtype)


IMPL = OpImpl(w8a8_matmul, OpCaps(FLOATS))
