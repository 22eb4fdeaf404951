"""SPEC 2.8 MoE grouped GEMM as ONNX functions: a Loop over experts; step e slices rows
group_offsets[e] : group_offsets[e+1] (rows are sorted by expert, so appending each expert's block
rebuilds the output in row order) and multiplies them by expert e's weight. Empty experts append an
empty block; the rows past the last offset (padding) are appended as zeros, never multiplied.
Quantized variants run the W8A8 / W4A8 functions on each expert's block, so each row is bitwise the
per-row GEMM of SPEC 2.6 / 2.7.
"""

from onnxscript import script

from backends.onnxruntime.functions._opsets import F32, I64, TOut, glm5, op
from backends.onnxruntime.functions.w4a8_matmul import w4a8_matmul
from backends.onnxruntime.functions.w8a8_matmul import w8a8_matmul


@script(glm5)
def _empty_rows(x, w, out_dtype: int):
    """[0, N] of out_dtype: the Loop's starting output."""
    shape = op.Concat(op.Constant(value_ints=[0]), op.Shape(w, start=1, end=2), axis=0)
    return op.Cast(op.ConstantOfShape(shape), to=out_dtype)


@script(glm5)
def _padding_rows(x, w, offs, out_dtype: int):
    """[M - group_offsets[E], N] zeros of out_dtype: the rows past the last expert's."""
    last = op.Gather(offs, op.Constant(value_ints=[-1]))
    shape = op.Concat(op.Sub(op.Shape(x, start=0, end=1), last), op.Shape(w, start=1, end=2), axis=0)
    return op.Cast(op.ConstantOfShape(shape), to=out_dtype)


@script(glm5)
def grouped_matmul(x, w, group_offsets, out_dtype: int) -> TOut:
    """x [M, K] float, w [E, N, K] same dtype, group_offsets [E+1] -> [M, N] out_dtype (fp32 accumulation).
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)"""
    offs = op.Cast(group_offsets, to=I64)
    out = _empty_rows(x, w, out_dtype=out_dtype)
    one = op.Constant(value_ints=[1])
    for e in range(op.Squeeze(op.Shape(w, start=0, end=1))):
        e1 = op.Reshape(e, one)
        rows = op.Slice(x, op.Gather(offs, e1), op.Gather(offs, op.Add(e1, one)), op.Constant(value_ints=[0]))
        we = op.Squeeze(op.Gather(w, e1, axis=0), op.Constant(value_ints=[0]))  # [N, K]
        y = op.MatMul(op.Cast(rows, to=F32), op.Transpose(op.Cast(we, to=F32), perm=[1, 0]))
        out = op.Concat(out, op.Cast(y, to=out_dtype), axis=0)
    return op.Concat(out, _padding_rows(x, w, offs, out_dtype=out_dtype), axis=0)


@script(glm5)
def grouped_matmul_w8a8(x, x_scale, w, w_scale, group_offsets, out_dtype: int) -> TOut:
    """x int8 [M, K], x_scale f32 [M], w int8 [E, N, K], w_scale f32 [E, N] -> [M, N] out_dtype.
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)"""
    offs = op.Cast(group_offsets, to=I64)
    out = _empty_rows(x, w, out_dtype=out_dtype)
    one = op.Constant(value_ints=[1])
    zero = op.Constant(value_ints=[0])
    for e in range(op.Squeeze(op.Shape(w, start=0, end=1))):
        e1 = op.Reshape(e, one)
        r0 = op.Gather(offs, e1)
        r1 = op.Gather(offs, op.Add(e1, one))
        y = w8a8_matmul(
            op.Slice(x, r0, r1, zero),
            op.Slice(x_scale, r0, r1, zero),
            op.Squeeze(op.Gather(w, e1, axis=0), zero),
            op.Squeeze(op.Gather(w_scale, e1, axis=0), zero),
            out_dtype=out_dtype,
        )
        out = op.Concat(out, y, axis=0)
    return op.Concat(out, _padding_rows(x, w, offs, out_dtype=out_dtype), axis=0)


@script(glm5)
def grouped_matmul_w4a8(x, x_scale, w, w_scale, group_offsets, group_size: int, out_dtype: int) -> TOut:
    """x int8 [M, K], x_scale f32 [M], w uint8 [E, N, K//2] (SPEC 2.7 packing),
    w_scale f32 [E, N, K // group_size] -> [M, N] out_dtype.
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)"""
    offs = op.Cast(group_offsets, to=I64)
    out = _empty_rows(x, w, out_dtype=out_dtype)
    one = op.Constant(value_ints=[1])
    zero = op.Constant(value_ints=[0])
    for e in range(op.Squeeze(op.Shape(w, start=0, end=1))):
        e1 = op.Reshape(e, one)
        r0 = op.Gather(offs, e1)
        r1 = op.Gather(offs, op.Add(e1, one))
        y = w4a8_matmul(
            op.Slice(x, r0, r1, zero),
            op.Slice(x_scale, r0, r1, zero),
            op.Squeeze(op.Gather(w, e1, axis=0), zero),
            op.Squeeze(op.Gather(w_scale, e1, axis=0), zero),
            group_size=group_size,
            out_dtype=out_dtype,
        )
        out = op.Concat(out, y, axis=0)
    return op.Concat(out, _padding_rows(x, w, offs, out_dtype=out_dtype), axis=0)
