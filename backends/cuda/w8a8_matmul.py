"""cuda backend: w8a8_matmul -> kernels_cuda.w8a8_matmul (int8 tl.dot, exact int32, reference epilogue).

Declines K past the int32 accumulator's guaranteed range (|x_q * w_q| <= 128 * 128 per product).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS

#: the largest K whose int32 sum of int8 products cannot overflow: 128 * 128 * K < 2**31
MAX_K = (2**31 - 1) // (128 * 128)


K_LIMIT = Limit("K", max=MAX_K, reason="an int32 accumulator of int8 products may overflow")


def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K], x_scale: float32 [M], w_q: int8 [N, K], w_scale: float32 [N], bias: [N] or None
    -> [M, N] out_dtype.

    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
    """
    from kernels_cuda.w8a8_matmul import w8a8_matmul as kernel

    return kernel(
        x_q,
        x_scale.contiguous(),
        w_q,
        w_scale.contiguous(),
        None if bias is None else bias.contiguous(),
        out_dtype,
    )


IMPL = OpImpl(w8a8_matmul, OpCaps(FLOATS, limits=(K_LIMIT,)))
