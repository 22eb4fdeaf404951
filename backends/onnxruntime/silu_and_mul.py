"""onnxruntime backend: silu_and_mul -> glm5.silu_and_mul (functions/silu_and_mul.py).

Inference only (no backward), as the backend's other ops: the products in fp32 in the reference's order,
rounded once; ORT's Sigmoid is its own approximation, so within the op's tolerance, not bitwise.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import inference_only, run


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [M, 2N] float = [gate | up] -> silu(gate) * up [M, N], dtype of x.
    Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)"""
    (out,) = run("silu_and_mul", "silu_and_mul", {"x": x}, [("out", x.dtype, 2)])
    return out


IMPL = OpImpl(silu_and_mul, OpCaps(FLOATS, check=inference_only("x")))
