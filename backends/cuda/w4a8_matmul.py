"""cuda backend: w4a8_matmul -> kernels_cuda.w4a8_matmul (in-kernel int4 unpack, exact int32 per group).

Any group_size dividing K is served (per-channel is group_size == K); one that is not a multiple of
32 runs with masked K steps (correct, slower). Declines groups past the int32 range (128 * 8 per product).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS

#: the largest group whose int32 sum of int8 x int4 products cannot overflow: 128 * 8 * group < 2**31
MAX_GROUP = (2**31 - 1) // (128 * 8)


GROUP_LIMIT = Limit("group_size", max=MAX_GROUP, reason="an int32 group accumulator may overflow")


def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K], x_scale: float32 [M], w_packed: uint8 [N, K // 2],
    w_scale: float32 [N, K // group_size], bias: [N] or None -> [M, N] out_dtype.

    Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
    """
    from kernels_cuda.w4a8_matmul import w4a8_matmul as kernel

    return kernel(
        x_q,
        x_scale.contiguous(),
        w_packed,
        w_scale,
        group_size,
        None if bias is None else bias.contiguous(),
        out_dtype,
    )


IMPL = OpImpl(w4a8_matmul, OpCaps(FLOATS, limits=(GROUP_LIMIT,)))
