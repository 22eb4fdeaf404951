"""onnxruntime backend: w8a8_matmul -> glm5.w8a8_matmul[_bias] (functions/w8a8_matmul.py).

MatMulInteger accumulates in int32: exact while 128 * 128 * K < 2^31, so K is limited to 131072.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import onnx_dtype, run

#: largest K whose int8 x int8 sums (|x| <= 128, |w| <= 128) cannot overflow MatMulInteger's int32
MAX_K = (2**31 - 1) // (128 * 128)


K_REASON = "MatMulInteger's int32 accumulator could overflow"


def empty_k_epilogue(
    m: int, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """K = 0: the int32 sum is empty (0), so the output is the epilogue of zero. ORT's MatMulInteger
    returns an uninitialised [M, N] buffer for an empty inner dimension, so this case never reaches it."""
    acc = torch.zeros(m, w_scale.shape[0], dtype=torch.float32, device=w_scale.device)
    out = acc * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K]; x_scale: f32 [M]; w_q: int8 [N, K]; w_scale: f32 [N]; bias: [N] or None
    -> [M, N] out_dtype.
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)"""
    if x_q.shape[1] == 0:
        return empty_k_epilogue(x_q.shape[0], x_scale, w_scale, bias, out_dtype)
    inputs = {"x_q": x_q, "x_scale": x_scale, "w_q": w_q, "w_scale": w_scale}
    if bias is not None:
        inputs["bias"] = bias
    fn = "w8a8_matmul" if bias is None else "w8a8_matmul_bias"
    (out,) = run("w8a8_matmul", fn, inputs, [("out", out_dtype, 2)], out_dtype=onnx_dtype(out_dtype))
    return out


IMPL = OpImpl(w8a8_matmul, OpCaps(FLOATS, limits=(Limit("K", max=MAX_K, reason=K_REASON),)))
