"""SPEC 2.10 SwiGLU activation as an ONNX function.

    x [M, 2N] = [gate | up] -> silu(gate) * up [M, N], silu(g) = g * sigmoid(g)

Both halves are cast to fp32, the products taken there in the reference's order ((g * s) * up) and the
result rounded once to the dtype of x (CastLike). ONNX Sigmoid is ORT's own vectorised fp32 approximation,
not torch's (a few ulps apart; 0 far in the negative tail, where torch has ~1e-26), so the function agrees
with the reference to the tolerance of SPEC 4, not bitwise.
"""

from onnxscript import script

from backends.onnxruntime.functions._opsets import F32, TFloat, glm5, op


@script(glm5)
def silu_and_mul(x: TFloat) -> TFloat:
    """x [M, 2N] float -> [M, N] dtype of x.
    Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)"""
    gate, up = op.Split(op.Cast(x, to=F32), axis=1, num_outputs=2)
    return op.CastLike(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), x)
