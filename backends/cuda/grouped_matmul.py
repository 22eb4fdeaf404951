"""cuda backend: grouped_matmul -> kernels_cuda.grouped_matmul (one launch for all experts; float/W8A8/W4A8).

The float variant never uses TF32 for fp32 inputs. Quantized variants decline accumulators that could
overflow int32, as w8a8_matmul / w4a8_matmul do. The float variant is differentiable in x and w
(`backward`: two launches, no host read; dx reads w through a transposed view, no re-layout).

In the layout-invariant mode (SPEC 12) the float variant is one exact product per non-empty expert on the
Triton engine (a row's grid is its own, so neither the expert's other rows nor the row count enters): one
host read of the offsets, as the reference. The quantized variants are unchanged there: their integer
dots are exact and each row's epilogue its own, bitwise the reference's in both modes.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.cuda._invariant import ENGINE
from backends.cuda._tiles import SHARED_TILE_NOTE, SHARED_TILE_ROWS_INVARIANT
from backends.cuda.w4a8_matmul import MAX_GROUP
from backends.cuda.w8a8_matmul import MAX_K
from backends.invariant import engine as invariant

LIMITS = (
    Limit("K", max=MAX_K, reason="an int32 accumulator of int8 products may overflow", when=("w8a8",)),
    Limit("group_size", max=MAX_GROUP, reason="an int32 group accumulator may overflow", when=("w4a8",)),
)


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Expert-sorted rows times their expert's weight (variants as `Backend.grouped_matmul`): x [M, K],
    w [E, N, K] (uint8 [E, N, K // 2] for W4A8), group_offsets [E+1] -> [M, N].

    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
    """
    from kernels_cuda.grouped_matmul import grouped_matmul as kernel

    if x.dtype.is_floating_point and invariant.active():
        return invariant.exact_grouped_matmul(x, w, group_offsets, out_dtype or x.dtype, ENGINE)
    return kernel(
        x, w, group_offsets, None if x_scale is None else x_scale.contiguous(), w_scale, group_size, out_dtype
    )


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the float variant -> kernels_cuda.grouped_matmul.grouped_matmul_backward.
    Semantics: backends/reference/grouped_matmul.py"""
    from kernels_cuda.grouped_matmul import grouped_matmul_backward

    (grad,) = grad_outputs
    return grouped_matmul_backward(grad, args["x"], args["w"], args["group_offsets"])


IMPL = OpImpl(
    grouped_matmul,
    OpCaps(
        FLOATS + ("w8a8", "w4a8"),
        limits=LIMITS,
        differentiable=True,
        notes={"launches": "one for all experts (backward: two)", **SHARED_TILE_NOTE},
        batch_invariant=SHARED_TILE_ROWS_INVARIANT,
        layout_invariant=True,
    ),
    backward=backward,
)
