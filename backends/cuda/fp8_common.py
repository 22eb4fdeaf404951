"""What the cuda backend's FP8 adapters share: the reasons a GPU cannot run e4m3 tensor-core dots."""

from __future__ import annotations

from typing import Any

import torch

from backends.caps import OpCaps
from backends.contract.ops import FLOATS
from backends.cuda._tiles import SHARED_TILE_NOTE, SHARED_TILE_ROWS_INVARIANT

#: e4m3 tensor-core dots: sm_89 (Ada) and sm_90+ (Hopper, Blackwell)
MIN_CAPABILITY = (8, 9)


def fp8_reasons(_args: dict[str, Any]) -> list[str]:
    """[] under the interpreter (NumPy runs the dots) or on an sm_89+ GPU; else why not."""
    from kernels_cuda import interpreter_active

    if interpreter_active() or not torch.cuda.is_available():
        return []
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return [f"GPU compute capability {cap[0]}.{cap[1]} < 8.9: no e4m3 tensor-core dot (Ada/Hopper+)"]
    return []


def chain(*checks):
    def check(args: dict[str, Any]) -> list[str]:
        return [r for c in checks for r in c(args)]

    return check


#: what fp8_block_matmul and fp8_grouped_matmul promise: e4m3 dots on sm_89+ (or the interpreter), rows of
#: several tokens in one tile (backends/cuda/_tiles.py)
GEMM_CAPS = OpCaps(
    FLOATS,
    notes={"GPU": "sm_89+", **SHARED_TILE_NOTE},
    check=fp8_reasons,
    batch_invariant=SHARED_TILE_ROWS_INVARIANT,
)
