"""cuda backend: dynamic_quant_int8 -> kernels_cuda.dynamic_quant_int8.

Every float input dtype is served bitwise equal to the reference: the kernel widens to fp32 exactly,
divides with correct rounding and rounds half to even (see the kernel header).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (x_q int8 [M, K], scale float32 [M]).

    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
    """
    from kernels_cuda.dynamic_quant_int8 import dynamic_quant_int8 as kernel

    return kernel(x)


IMPL = OpImpl(
    dynamic_quant_int8,
    OpCaps(
        FLOATS,
        notes={
            "numerics": "bitwise equal to the reference for finite x",
            # NaN/inf rows: the reference casts a NaN quotient to int8 (undefined in C); the kernel clamps it
            "non-finite x": "not claimed",
        },
    ),
)
