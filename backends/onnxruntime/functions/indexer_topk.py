"""SPEC 2.2 indexer top-k as ONNX functions: score one key chunk at a time and merge into a running
top-k inside a Loop, so the [T, S] logits never exist (peak extra memory O(T * (topk + chunk)) plus
one chunk's [T, chunk, D_I] keys and [T, H_I, chunk] dots).

The running state starts as `topk` non-candidate slots and stays [T, topk]: each step ranks
[running | chunk] with the SPEC 2.3 key of topk.py. Running entries all have lower key positions
than the chunk's and are already in rule order, so TopK's lower-position tie rule keeps ties in
lower-index order across chunks, exactly as the reference's merge.
"""

from onnxscript import INT32, script

from backends.onnxruntime.functions._layout import (
    causal_visible,
    paged_row_map,
    ragged_row_map,
    token_request,
)
from backends.onnxruntime.functions._opsets import I32, glm5, op
from backends.onnxruntime.functions.indexer_logits import score_positions
from backends.onnxruntime.functions.topk import NOT_CANDIDATE, rank_key


@script(glm5)
def indexer_topk_rows(
    q, cache_flat, weights, cu_seqlens_q, seqlens_k, row_map, topk: int, chunk: int
) -> INT32:
    """Layout-independent body: cache_flat [rows, D_I], row_map [B, S_max + 1] -> int32 [T, topk]."""
    req = token_request(cu_seqlens_q, q)
    visible, s = causal_visible(cu_seqlens_q, seqlens_k, req)
    visible_col = op.Unsqueeze(visible, op.Constant(value_ints=[1]))
    kk = op.Unsqueeze(op.Constant(value_int=topk), op.Constant(value_ints=[0]))
    t_dim = op.Shape(q, start=0, end=1)
    best_key = op.Expand(op.Constant(value=NOT_CANDIDATE), op.Concat(t_dim, kk, axis=0))
    best_idx = op.Expand(op.Constant(value_int=-1), op.Concat(t_dim, kk, axis=0))
    width = op.Constant(value_int=chunk)
    s_max = op.Squeeze(op.Sub(op.Shape(row_map, start=1, end=2), op.Constant(value_ints=[1])))
    n_chunks = op.Div(op.Add(s_max, op.Sub(width, op.Constant(value_int=1))), width)
    for i in range(n_chunks):
        c0 = op.Mul(i, width)
        c1 = op.Min(op.Add(c0, width), s_max)
        pos = op.Unsqueeze(op.Range(c0, c1, op.Constant(value_int=1)), op.Constant(value_ints=[0]))
        pos = op.Expand(
            pos, op.Concat(t_dim, op.Reshape(op.Sub(c1, c0), op.Constant(value_ints=[1])), axis=0)
        )
        logits = score_positions(q, cache_flat, weights, row_map, req, pos, visible)  # [T, n]
        key = rank_key(logits, op.Less(pos, visible_col))
        top, at = op.TopK(op.Concat(best_key, key, axis=1), kk, axis=1, largest=1, sorted=1)
        best_idx = op.GatherElements(op.Concat(best_idx, pos, axis=1), at, axis=1)
        best_key = top
    taken = op.Greater(best_key, op.Constant(value=NOT_CANDIDATE))
    return op.Cast(op.Where(taken, best_idx, op.Constant(value_int=-1)), to=I32)


@script(glm5)
def indexer_topk_ragged(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, topk: int, chunk: int
) -> INT32:
    """q [T, H_I, D_I], k_cache [rows, D_I], weights [T, H_I] fp32 -> int32 [T, topk] logical positions,
    -1 past the causal keys. Semantics: backends/reference/indexer_topk.py (SPEC 2.2)"""
    row_map = ragged_row_map(seqlens_k, cu_seqlens_k)
    return indexer_topk_rows(q, k_cache, weights, cu_seqlens_q, seqlens_k, row_map, topk=topk, chunk=chunk)


@script(glm5)
def indexer_topk_paged(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table, topk: int, chunk: int
) -> INT32:
    """As indexer_topk_ragged with a paged cache [nb, bs, D_I] and block_table [B, max_blocks].
    Semantics: backends/reference/indexer_topk.py (SPEC 2.2)"""
    row_map = paged_row_map(seqlens_k, block_table, k_cache)
    flat = op.Reshape(
        k_cache, op.Concat(op.Constant(value_ints=[-1]), op.Shape(k_cache, start=2, end=3), axis=0)
    )
    return indexer_topk_rows(q, flat, weights, cu_seqlens_q, seqlens_k, row_map, topk=topk, chunk=chunk)
