"""SPEC 2.4 sparse MLA attention (absorbed form) as ONNX functions.

    valid(t) = { j in indices[t] : 0 <= j < seqlens_k[b(t)] }
    out[t,h] = softmax_j(sm_scale * q[t,h] . K_j) @ K_j[:d_v],   lse natural log; empty: 0 and -inf

Invalid slots gather the row map's spare column (row 0) and are zeroed by Where before any
arithmetic, so NaN in unread cache rows never reaches the result. The softmax is max-shifted in
fp32 (the reference exponentiates p - lse; the two agree to rounding). Duplicated indices count
twice: nothing deduplicates.
"""

from onnxscript import FLOAT, script

from backends.onnxruntime.functions._layout import (
    flat_rows,
    paged_row_map,
    ragged_row_map,
    token_request,
)
from backends.onnxruntime.functions._opsets import F32, I64, TFloat, glm5, op


@script(glm5)
def sparse_mla_rows(q, cache_flat, indices, cu_seqlens_q, seqlens_k, row_map, sm_scale: float, d_v: int):
    """Layout-independent body: cache_flat [rows, d_qk], row_map [B, S_max + 1] -> (out, lse)."""
    req = token_request(cu_seqlens_q, q)
    s = op.Unsqueeze(op.Gather(op.Cast(seqlens_k, to=I64), req), op.Constant(value_ints=[1]))  # [T, 1]
    idx = op.Cast(indices, to=I64)  # [T, K]
    valid = op.And(op.GreaterOrEqual(idx, op.Constant(value_int=0)), op.Less(idx, s))
    keys = op.Cast(op.Gather(cache_flat, flat_rows(row_map, req, idx)), to=F32)  # [T, K, d_qk]
    keys = op.Where(op.Unsqueeze(valid, op.Constant(value_ints=[2])), keys, op.Constant(value_float=0.0))
    p = op.MatMul(op.Cast(q, to=F32), op.Transpose(keys, perm=[0, 2, 1]))  # [T, H, K]
    p = op.Mul(p, op.Constant(value_float=sm_scale))
    p = op.Where(op.Unsqueeze(valid, op.Constant(value_ints=[1])), p, op.Constant(value_float=float("-inf")))
    last = op.Constant(value_ints=[-1])
    m = op.ReduceMax(p, last, keepdims=1)  # [T, H, 1]
    m = op.Where(op.IsInf(m), op.Constant(value_float=0.0), m)  # empty rows
    e = op.Exp(op.Sub(p, m))
    total = op.ReduceSum(e, last, keepdims=1)
    lse = op.Squeeze(op.Add(op.Log(total), m), last)  # log(0) = -inf
    values = op.Slice(
        keys,
        op.Constant(value_ints=[0]),
        op.Unsqueeze(op.Constant(value_int=d_v), op.Constant(value_ints=[0])),
        last,
    )  # [T, K, d_v]
    denom = op.Where(op.Equal(total, op.Constant(value_float=0.0)), op.Constant(value_float=1.0), total)
    out = op.Div(op.MatMul(e, values), denom)
    return op.CastLike(out, q), lse


@script(glm5)
def sparse_mla_attention_ragged(
    q: TFloat, kv_cache, indices, cu_seqlens_q, seqlens_k, cu_seqlens_k, sm_scale: float, d_v: int
) -> tuple[TFloat, FLOAT]:
    """q [T, H, d_qk], kv_cache [rows, d_qk], indices int32 [T, topk] logical positions ->
    (out [T, H, d_v] dtype of q, lse [T, H] fp32).
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)"""
    row_map = ragged_row_map(seqlens_k, cu_seqlens_k)
    out, lse = sparse_mla_rows(
        q, kv_cache, indices, cu_seqlens_q, seqlens_k, row_map, sm_scale=sm_scale, d_v=d_v
    )
    return out, lse


@script(glm5)
def sparse_mla_attention_paged(
    q: TFloat, kv_cache, indices, cu_seqlens_q, seqlens_k, block_table, sm_scale: float, d_v: int
) -> tuple[TFloat, FLOAT]:
    """As sparse_mla_attention_ragged with a paged cache [nb, bs, d_qk] and block_table [B, max_blocks].
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)"""
    row_map = paged_row_map(seqlens_k, block_table, kv_cache)
    flat = op.Reshape(
        kv_cache, op.Concat(op.Constant(value_ints=[-1]), op.Shape(kv_cache, start=2, end=3), axis=0)
    )
    out, lse = sparse_mla_rows(q, flat, indices, cu_seqlens_q, seqlens_k, row_map, sm_scale=sm_scale, d_v=d_v)
    return out, lse
