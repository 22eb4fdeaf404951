"""SeqLayout (SPEC 1) in standard ONNX: the graph consumes the layout's own tensors and computes,
per query row, its request, its causal key count, and the physical cache row of every logical key
position (from `cu_seqlens_k` or from `block_table`), so no host-side translation is needed.

Row maps are [B, S_max + 1] int64. Column S_max and every position >= seqlens_k[b] hold row 0: a
slot that ops may gather but always discard with `Where` (never through arithmetic), so NaN in
unused cache rows cannot leak.
"""

from onnxscript import INT64, script

from backends.onnxruntime.functions._opsets import I64, glm5, op


@script(glm5)
def token_request(cu_seqlens_q, q) -> INT64:
    """[T] int64: the request b owning query row t (cu_seqlens_q[b] <= t < cu_seqlens_q[b+1])."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    t = op.Range(zero, op.Squeeze(op.Shape(q, start=0, end=1)), one)  # [T]
    ends = op.Cast(
        op.Slice(cu_seqlens_q, op.Constant(value_ints=[1]), op.Constant(value_ints=[9223372036854775807])),
        to=I64,
    )  # [B]
    # empty requests are skipped naturally: every request ending at or before t precedes b(t)
    past = op.GreaterOrEqual(
        op.Unsqueeze(t, op.Constant(value_ints=[1])), op.Unsqueeze(ends, op.Constant(value_ints=[0]))
    )  # [T, B]
    return op.ReduceSum(op.Cast(past, to=I64), op.Constant(value_ints=[1]), keepdims=0)


@script(glm5)
def causal_visible(cu_seqlens_q, seqlens_k, req):
    """(visible [T], seqlen [T]) int64: keys row t may see under right-down causality
    (j <= seqlens_k[b] - T_b + i) and its request's key count."""
    cu = op.Cast(cu_seqlens_q, to=I64)
    one = op.Constant(value_int=1)
    start = op.Gather(cu, req)
    end = op.Gather(cu, op.Add(req, one))
    s = op.Gather(op.Cast(seqlens_k, to=I64), req)
    t = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(req)), one)
    vis = op.Add(op.Sub(s, op.Sub(end, start)), op.Add(op.Sub(t, start), one))
    vis = op.Max(op.Min(vis, s), op.Constant(value_int=0))
    return vis, s


@script(glm5)
def _positions(seqlens_k):
    """(p [S_max + 1], valid [B, S_max + 1], sk [B]) for the row maps."""
    sk = op.Cast(seqlens_k, to=I64)  # [B]
    zero1 = op.Constant(value_ints=[0])
    s_max = op.ReduceMax(op.Concat(sk, zero1, axis=0), zero1, keepdims=0)  # 0 when B == 0
    p = op.Range(op.Constant(value_int=0), op.Add(s_max, op.Constant(value_int=1)), op.Constant(value_int=1))
    valid = op.Less(op.Unsqueeze(p, zero1), op.Unsqueeze(sk, op.Constant(value_ints=[1])))
    return p, valid, sk


@script(glm5)
def ragged_row_map(seqlens_k, cu_seqlens_k) -> INT64:
    """[B, S_max + 1]: position p of request b is row cu_seqlens_k[b] + p of the [rows, D] cache."""
    p, valid, sk = _positions(seqlens_k)
    start = op.Cast(op.Slice(cu_seqlens_k, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])), to=I64)
    rows = op.Add(
        op.Unsqueeze(start, op.Constant(value_ints=[1])), op.Unsqueeze(p, op.Constant(value_ints=[0]))
    )
    return op.Where(valid, rows, op.Constant(value_int=0))


@script(glm5)
def paged_row_map(seqlens_k, block_table, k_cache) -> INT64:
    """[B, S_max + 1]: position p of request b is row block_table[b, p // bs] * bs + p % bs of the
    cache flattened to [nb * bs, D]."""
    p, valid, sk = _positions(seqlens_k)
    bs = op.Shape(k_cache, start=1, end=2)  # [1]
    pc = op.Where(valid, op.Unsqueeze(p, op.Constant(value_ints=[0])), op.Constant(value_int=0))
    # one spare column: a table with no columns (every request empty) still has a column to read
    bt = op.Cast(block_table, to=I64)
    bt = op.Concat(
        bt,
        op.Expand(
            op.Constant(value_ints=[-1]),
            op.Concat(op.Shape(bt, start=0, end=1), op.Constant(value_ints=[1]), axis=0),
        ),
        axis=1,
    )
    block = op.GatherElements(bt, op.Div(pc, bs), axis=1)
    rows = op.Add(op.Mul(block, bs), op.Mod(pc, bs))
    return op.Where(valid, rows, op.Constant(value_int=0))


@script(glm5)
def flat_rows(row_map, req, pos):
    """Physical rows of logical positions `pos` [T, n] (any value; invalid ones must be masked by the
    caller) of each row's request `req` [T] -> [T, n] int64. Out-of-range positions read column S_max."""
    width = op.Shape(row_map, start=1, end=2)  # [1] = S_max + 1
    s_max = op.Sub(width, op.Constant(value_ints=[1]))
    in_range = op.And(op.GreaterOrEqual(pos, op.Constant(value_int=0)), op.Less(pos, s_max))
    col = op.Where(in_range, pos, s_max)
    flat = op.Add(op.Mul(op.Unsqueeze(req, op.Constant(value_ints=[1])), width), col)
    return op.Gather(op.Reshape(row_map, op.Constant(value_ints=[-1])), flat)
