"""onnxruntime backend: w4a8_matmul -> glm5.w4a8_matmul[_bias] (functions/w4a8_matmul.py)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import onnx_dtype, run
from backends.onnxruntime.w8a8_matmul import K_REASON, MAX_K


def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K]; x_scale: f32 [M]; w_packed: uint8 [N, K//2]; w_scale: f32 [N, K // group_size];
    bias: [N] or None -> [M, N] out_dtype. Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)"""
    inputs = {"x_q": x_q, "x_scale": x_scale, "w_packed": w_packed, "w_scale": w_scale}
    if bias is not None:
        inputs["bias"] = bias
    fn = "w4a8_matmul" if bias is None else "w4a8_matmul_bias"
    (out,) = run(
        "w4a8_matmul",
        fn,
        inputs,
        [("out", out_dtype, 2)],
        group_size=group_size,
        out_dtype=onnx_dtype(out_dtype),
    )
    return out


LIMITS = (
    Limit("group_size", max=MAX_K, reason=K_REASON),
    Limit("K", min=1, reason="no groups to accumulate (the function slices K into K // group_size groups)"),
)
IMPL = OpImpl(w4a8_matmul, OpCaps(FLOATS, limits=LIMITS))
