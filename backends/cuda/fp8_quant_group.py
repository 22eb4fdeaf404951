"""cuda backend: fp8_quant_group (SPEC 7.1) -> kernels_cuda.fp8_quant (one program per row x group; bitwise
the reference: the e4m3 rounding is done in fp32 arithmetic before the cast)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from kernels_cuda.fp8_quant import fp8_quant_group as _kernel

MAX_GROUP = 4096


def fp8_quant_group(
    x: torch.Tensor, group_size: int = 128, eps: float = 1e-4, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (e4m3 [M, K], fp32 [M, ceil(K / group_size)]).
    Semantics: backends/reference/fp8_quant_group.py (SPEC 7.1)"""
    return _kernel(x, group_size, eps, ue8m0)


GROUP_LIMIT = Limit("group_size", max=MAX_GROUP, reason="a group is one register tile")
IMPL = OpImpl(fp8_quant_group, OpCaps(FLOATS, limits=(GROUP_LIMIT,)))
