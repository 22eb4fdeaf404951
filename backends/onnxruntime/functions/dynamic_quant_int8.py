"""SPEC 2.5 per-row symmetric int8 quantization as an ONNX function.

    scale = max(amax_row, 1e-10) / 127,   x_q = clamp(round_half_even(x / scale), -127, 127)

ONNX Round is half-to-even, as torch.round; the fp32 division and clamp are exact IEEE operations,
so the result is bitwise the reference's. A row holding NaN has scale NaN and codes 0, as the reference
(torch's amax propagates NaN; ORT's ReduceMax skips it, so the NaN is put back explicitly, and a NaN
quotient, which ONNX's Clip and Cast leave undefined, becomes code 0).
"""

from onnxscript import FLOAT, INT8, script

from backends.onnxruntime.functions._opsets import BOOL, F32, I8, glm5, op


@script(glm5)
def dynamic_quant_int8(x) -> tuple[INT8, FLOAT]:
    """x [M, K] float -> (x_q int8 [M, K], scale float32 [M]).
    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)"""
    xf = op.Cast(x, to=F32)
    amax = op.ReduceMax(op.Abs(xf), op.Constant(value_ints=[1]), keepdims=1)  # [M, 1]
    nan_count = op.ReduceSum(op.Cast(op.IsNaN(xf), to=F32), op.Constant(value_ints=[1]), keepdims=1)
    has_nan = op.Cast(nan_count, to=BOOL)  # [M, 1]
    scale = op.Div(op.Max(amax, op.Constant(value_float=1e-10)), op.Constant(value_float=127.0))
    scale = op.Where(has_nan, op.Constant(value_float=float("nan")), scale)  # [M, 1]
    r = op.Round(op.Div(xf, scale))
    r = op.Where(op.IsNaN(r), op.Constant(value_float=0.0), r)
    q = op.Clip(r, op.Constant(value_float=-127.0), op.Constant(value_float=127.0))
    return op.Cast(q, to=I8), op.Squeeze(scale, op.Constant(value_ints=[1]))
