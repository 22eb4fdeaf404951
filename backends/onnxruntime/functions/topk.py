"""SPEC 2.3 deterministic top-k as ONNX functions.

ONNX TopK (sorted, largest) already breaks ties by the lower index, and ONNX Runtime's CPU kernel
does so bitwise, at every size we measured (up to 300k columns, k = 2048). What it does not do is
SPEC's NaN rule: ORT ranks NaN above +inf. So TopK runs on a float64 rank key in which every float32
number keeps its order (-0.0 == +0.0 compare equal), -inf becomes -1e300, NaN -2e300 and a
non-candidate -inf: below every finite float32, in SPEC's order. Float64 holds every float32 exactly,
so no two distinct numbers collide.

Rows are prefixed with k non-candidate slots before TopK, so k may exceed the column count without a
dynamic Min/Pad, and an empty row still has k slots to select: prefix slots, like every non-candidate,
come out as index -1 / value -inf.
"""

import numpy as np
from onnx import numpy_helper
from onnxscript import INT32, script

from backends.onnxruntime.functions._opsets import F64, I32, I64, TFloat, glm5, op

# float64 rank-key constants (Constant has no value_double attribute in opset 18)
KEY_NEG_INF = numpy_helper.from_array(np.array(-1e300, dtype=np.float64), "key_neg_inf")
KEY_NAN = numpy_helper.from_array(np.array(-2e300, dtype=np.float64), "key_nan")
NOT_CANDIDATE = numpy_helper.from_array(np.array(-np.inf, dtype=np.float64), "not_candidate")


@script(glm5)
def rank_key(v, candidate):
    """float64 key of the same shape whose descending order, ties by position, is SPEC 2.3's."""
    d = op.Cast(v, to=F64)
    d = op.Where(op.IsInf(d, detect_positive=0), op.Constant(value=KEY_NEG_INF), d)
    d = op.Where(op.IsNaN(d), op.Constant(value=KEY_NAN), d)
    return op.Where(candidate, d, op.Constant(value=NOT_CANDIDATE))


@script(glm5)
def prefixed_topk(key, k: int):
    """TopK of `key` [R, C] (from rank_key) behind k non-candidate slots -> (taken [R, k] bool,
    position [R, k] int64 in the prefixed row: column = position - k)."""
    kk = op.Unsqueeze(op.Constant(value_int=k), op.Constant(value_ints=[0]))
    rows = op.Shape(key, start=0, end=1)
    pad = op.Expand(op.Constant(value=NOT_CANDIDATE), op.Concat(rows, kk, axis=0))
    top, pos = op.TopK(op.Concat(pad, key, axis=1), kk, axis=1, largest=1, sorted=1)
    taken = op.Greater(top, op.Constant(value=NOT_CANDIDATE))
    return taken, pos


@script(glm5)
def topk_lengths(x: TFloat, lengths, k: int) -> tuple[TFloat, INT32]:
    """x [R, C] float, lengths [R] int32/int64 (columns < lengths[r] are candidates) ->
    (values [R, k] dtype of x, indices [R, k] int32); -inf / -1 past the candidates.
    Semantics: backends/reference/topk.py (SPEC 2.3)"""
    cols = op.Range(
        op.Constant(value_int=0), op.Squeeze(op.Shape(x, start=1, end=2)), op.Constant(value_int=1)
    )
    candidate = op.Less(
        op.Unsqueeze(cols, op.Constant(value_ints=[0])),
        op.Unsqueeze(op.Cast(lengths, to=I64), op.Constant(value_ints=[1])),
    )
    taken, pos = prefixed_topk(rank_key(x, candidate), k=k)
    kk = op.Constant(value_int=k)
    indices = op.Cast(op.Where(taken, op.Sub(pos, kk), op.Constant(value_int=-1)), to=I32)
    # values are gathered from x itself (no cast, no arithmetic), so bits such as -0.0 and NaN payloads
    # survive; slots not taken read prefix slot 0, which holds -inf
    # Expand in float32, then cast: ORT's CPU Expand has no bfloat16 kernel
    pad = op.CastLike(
        op.Expand(
            op.Constant(value_float=float("-inf")),
            op.Concat(op.Shape(x, start=0, end=1), op.Unsqueeze(kk, op.Constant(value_ints=[0])), axis=0),
        ),
        x,
    )
    at = op.Where(taken, pos, op.Constant(value_int=0))
    values = op.GatherElements(op.Concat(pad, x, axis=1), at, axis=1)
    return values, indices


@script(glm5)
def topk(x: TFloat, k: int) -> tuple[TFloat, INT32]:
    """Every column a candidate: topk_lengths with lengths = C.
    Semantics: backends/reference/topk.py (SPEC 2.3)"""
    lengths = op.Expand(op.Shape(x, start=1, end=2), op.Shape(x, start=0, end=1))
    values, indices = topk_lengths(x, lengths, k=k)
    return values, indices


__all__ = ["KEY_NAN", "KEY_NEG_INF", "NOT_CANDIDATE", "prefixed_topk", "rank_key", "topk", "topk_lengths"]
