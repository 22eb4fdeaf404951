"""SPEC 2.6 W8A8 GEMM as ONNX functions.

    acc[m, n] = sum_k int32(x_q[m, k]) * int32(w_q[n, k])     MatMulInteger: exact int32
    out[m, n] = (float32(acc) * x_scale[m] * w_scale[n] + bias[n]).to(out_dtype)

The epilogue multiplies in the reference's order, so outputs match it bitwise. int32 stays exact
while 128 * 128 * K < 2^31 (K <= 131072); the backend declares that limit.
"""

from onnxscript import script

from backends.onnxruntime.functions._opsets import F32, TOut, glm5, op


@script(glm5)
def w8a8_acc(x_q, w_q):
    """x_q int8 [M, K], w_q int8 [N, K] -> acc int32 [M, N] (exact)."""
    return op.MatMulInteger(x_q, op.Transpose(w_q, perm=[1, 0]))


@script(glm5)
def w8a8_scaled(x_q, x_scale, w_q, w_scale):
    """fp32 [M, N] epilogue before bias: float32(acc) * x_scale[m] * w_scale[n]."""
    acc = op.Cast(w8a8_acc(x_q, w_q), to=F32)
    return op.Mul(
        op.Mul(acc, op.Unsqueeze(x_scale, op.Constant(value_ints=[1]))),
        op.Unsqueeze(w_scale, op.Constant(value_ints=[0])),
    )


@script(glm5)
def w8a8_matmul(x_q, x_scale, w_q, w_scale, out_dtype: int) -> TOut:
    """x_q int8 [M, K], x_scale f32 [M], w_q int8 [N, K], w_scale f32 [N] -> [M, N] out_dtype.
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)"""
    return op.Cast(w8a8_scaled(x_q, x_scale, w_q, w_scale), to=out_dtype)


@script(glm5)
def w8a8_matmul_bias(x_q, x_scale, w_q, w_scale, bias, out_dtype: int) -> TOut:
    """w8a8_matmul plus bias [N] (any float dtype, added in fp32).
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)"""
    out = op.Add(
        w8a8_scaled(x_q, x_scale, w_q, w_scale),
        op.Unsqueeze(op.Cast(bias, to=F32), op.Constant(value_ints=[0])),
    )
    return op.Cast(out, to=out_dtype)
