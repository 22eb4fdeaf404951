"""onnxruntime backend: dynamic_quant_int8 -> glm5.dynamic_quant_int8 (functions/dynamic_quant_int8.py)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import run


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (x_q int8 [M, K], scale float32 [M]).
    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)"""
    x_q, scale = run(
        "dynamic_quant_int8",
        "dynamic_quant_int8",
        {"x": x},
        [("x_q", torch.int8, 2), ("scale", torch.float32, 1)],
    )
    return x_q, scale


IMPL = OpImpl(dynamic_quant_int8, OpCaps(FLOATS))
