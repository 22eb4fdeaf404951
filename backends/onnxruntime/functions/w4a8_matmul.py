"""SPEC 2.7 W4A8 GEMM with per-group scales as ONNX functions.

Unpacking uses integer Mod/Div on int32 (no Bitwise* ops, so opset-13 toolchains can lower it):
byte b holds w[2i] = b mod 16 and w[2i+1] = b div 16, each mapped from [0, 15] to [-8, 7].
Each group's int32 accumulator is one slice of a batched MatMulInteger [G, M, gs] x [G, gs, N]
(exact). The groups are then summed in group order g = 0, 1, ... with CumSum, the reference's order,
so outputs match it bitwise (0 + a = a exactly, except that -0.0 becomes +0.0 there as well).
"""

from onnxscript import script

from backends.onnxruntime.functions._opsets import F32, I8, I32, TOut, glm5, op


@script(glm5)
def unpack_int4(w_packed):
    """uint8 [..., K//2] -> int8 [..., K] in [-8, 7]; w[2i] from the low nibble."""
    b = op.Cast(w_packed, to=I32)
    sixteen = op.Constant(value_int=16)
    nib = op.Concat(
        op.Unsqueeze(op.Mod(b, op.CastLike(sixteen, b)), op.Constant(value_ints=[-1])),
        op.Unsqueeze(op.Div(b, op.CastLike(sixteen, b)), op.Constant(value_ints=[-1])),
        axis=-1,
    )
    signed = op.Where(
        op.GreaterOrEqual(nib, op.CastLike(op.Constant(value_int=8), b)),
        op.Sub(nib, op.CastLike(sixteen, b)),
        nib,
    )
    shape = op.Concat(op.Shape(w_packed, start=0, end=-1), op.Constant(value_ints=[-1]), axis=0)
    return op.Cast(op.Reshape(signed, shape), to=I8)


@script(glm5)
def w4a8_scaled(x_q, x_scale, w_packed, w_scale, group_size: int):
    """fp32 [M, N] before bias: x_scale[m] * sum_g float32(acc_g[m, n]) * w_scale[n, g]."""
    w = unpack_int4(w_packed)  # [N, K]
    gs = op.Unsqueeze(op.Constant(value_int=group_size), op.Constant(value_ints=[0]))
    groups = op.Div(op.Shape(x_q, start=1, end=2), gs)  # explicit: -1 is ambiguous when M == 0
    split = op.Concat(op.Constant(value_ints=[0]), groups, gs, axis=0)
    xg = op.Transpose(op.Reshape(x_q, split), perm=[1, 0, 2])  # [G, M, gs]
    wg = op.Transpose(op.Reshape(w, split), perm=[1, 2, 0])  # [G, gs, N]
    acc = op.Cast(op.MatMulInteger(xg, wg), to=F32)  # [G, M, N]
    scaled = op.Mul(acc, op.Unsqueeze(op.Transpose(w_scale, perm=[1, 0]), op.Constant(value_ints=[1])))
    total = op.Gather(op.CumSum(scaled, op.Constant(value_int=0)), op.Constant(value_int=-1), axis=0)
    return op.Mul(op.Unsqueeze(x_scale, op.Constant(value_ints=[1])), total)


@script(glm5)
def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size: int, out_dtype: int) -> TOut:
    """x_q int8 [M, K], x_scale f32 [M], w_packed uint8 [N, K//2], w_scale f32 [N, K // group_size]
    -> [M, N] out_dtype. Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)"""
    return op.Cast(w4a8_scaled(x_q, x_scale, w_packed, w_scale, group_size=group_size), to=out_dtype)


@script(glm5)
def w4a8_matmul_bias(x_q, x_scale, w_packed, w_scale, bias, group_size: int, out_dtype: int) -> TOut:
    """w4a8_matmul plus bias [N] (any float dtype, added in fp32).
    Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)"""
    out = op.Add(
        w4a8_scaled(x_q, x_scale, w_packed, w_scale, group_size=group_size),
        op.Unsqueeze(op.Cast(bias, to=F32), op.Constant(value_ints=[0])),
    )
    return op.Cast(out, to=out_dtype)
