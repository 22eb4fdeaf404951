"""SPEC 2.9 linear + cross-entropy as an ONNX function (forward only): a Loop over row chunks, each
computing its [n, V] fp32 logits, a max-shifted logsumexp and the target logit, so the [N, V]
logits never exist at once; the per-row lse is the second output (what a backward reads). A chunk
holds at most `chunk_elems` logits (the backend passes 2^24, as the reference).

    loss = sum_{i counted} (lse_i - logit_i[target_i]) / count      (count 0: 0 / 0 = NaN, as torch)
"""

from onnxscript import FLOAT, script

from backends.onnxruntime.functions._opsets import F32, I64, glm5, op


@script(glm5)
def linear_cross_entropy(h, weight, targets, ignore_index: int, chunk_elems: int) -> tuple[FLOAT, FLOAT]:
    """h [N, D] float, weight [V, D] float, targets [N] int -> (scalar fp32 mean loss, lse fp32 [N]).
    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)"""
    wt = op.Transpose(op.Cast(weight, to=F32), perm=[1, 0])  # [D, V]
    tgt = op.Cast(targets, to=I64)
    counted = op.Not(op.Equal(tgt, op.Constant(value_int=ignore_index)))
    safe = op.Where(counted, tgt, op.Constant(value_int=0))
    n = op.Shape(h, start=0, end=1)
    v = op.Shape(weight, start=0, end=1)
    step = op.Max(
        op.Div(
            op.Unsqueeze(op.Constant(value_int=chunk_elems), op.Constant(value_ints=[0])),
            op.Max(v, op.Constant(value_ints=[1])),
        ),
        op.Constant(value_ints=[1]),
    )
    n_chunks = op.Squeeze(op.Div(op.Add(n, op.Sub(step, op.Constant(value_ints=[1]))), step))
    total = op.Constant(value_float=0.0)
    lses = op.Cast(op.ConstantOfShape(op.Constant(value_ints=[0])), to=F32)  # [0], grows by each chunk
    zero = op.Constant(value_ints=[0])
    last = op.Constant(value_ints=[-1])
    for i in range(n_chunks):
        r0 = op.Mul(op.Reshape(i, op.Constant(value_ints=[1])), step)
        r1 = op.Min(op.Add(r0, step), n)
        logits = op.MatMul(op.Cast(op.Slice(h, r0, r1, zero), to=F32), wt)  # [n, V]
        m = op.ReduceMax(logits, last, keepdims=1)
        lse = op.Add(op.Log(op.ReduceSum(op.Exp(op.Sub(logits, m)), last, keepdims=1)), m)
        picked = op.GatherElements(logits, op.Unsqueeze(op.Slice(safe, r0, r1, zero), last), axis=1)
        nll = op.Where(
            op.Unsqueeze(op.Slice(counted, r0, r1, zero), last),
            op.Sub(lse, picked),
            op.Constant(value_float=0.0),
        )
        total = op.Add(total, op.ReduceSum(nll, keepdims=0))
        lses = op.Concat(lses, op.Squeeze(lse, last), axis=0)
    return op.Div(total, op.ReduceSum(op.Cast(counted, to=F32), keepdims=0)), lses
