"""SPEC 2.1 lightning-indexer logits as ONNX functions.

    logits[t, j] = sum_h weights[t, h] * relu(dot(q[t, h], key_j))   causal j; else -inf

Keys are gathered per query row through the layout's row map ([T, S, D_I] for the whole request
width here; the top-k variant gathers one key chunk at a time). Inputs are cast to float32 after the
gather (never the whole cache); both contractions are MatMuls in fp32, so only the summation order
differs from the reference. Masked slots are replaced by Where, so NaN in unread rows cannot leak.
"""

from onnxscript import FLOAT, script

from backends.onnxruntime.functions._layout import (
    causal_visible,
    flat_rows,
    paged_row_map,
    ragged_row_map,
    token_request,
)
from backends.onnxruntime.functions._opsets import F32, glm5, op


@script(glm5)
def score_keys(q, keys, weights) -> FLOAT:
    """q [T, H_I, D_I], keys [T, n, D_I] (each row's own keys), weights [T, H_I] -> [T, n] fp32, no mask."""
    dots = op.MatMul(op.Cast(q, to=F32), op.Transpose(op.Cast(keys, to=F32), perm=[0, 2, 1]))  # [T, H_I, n]
    w = op.Unsqueeze(op.Cast(weights, to=F32), op.Constant(value_ints=[1]))  # [T, 1, H_I]
    return op.Squeeze(op.MatMul(w, op.Relu(dots)), op.Constant(value_ints=[1]))


@script(glm5)
def score_positions(q, cache_flat, weights, row_map, req, pos, visible) -> FLOAT:
    """Logits of logical positions pos [T, n] (int64) of each row's request; -inf where pos >= visible."""
    keys = op.Gather(cache_flat, flat_rows(row_map, req, pos))  # [T, n, D_I]
    causal = op.Less(pos, op.Unsqueeze(visible, op.Constant(value_ints=[1])))
    return op.Where(causal, score_keys(q, keys, weights), op.Constant(value_float=float("-inf")))


@script(glm5)
def indexer_logits_rows(q, cache_flat, weights, cu_seqlens_q, seqlens_k, row_map) -> FLOAT:
    """Layout-independent body: cache_flat [rows, D_I], row_map [B, S_max + 1] -> [T, S_max] fp32."""
    req = token_request(cu_seqlens_q, q)
    visible, s = causal_visible(cu_seqlens_q, seqlens_k, req)
    s_max = op.Squeeze(op.Sub(op.Shape(row_map, start=1, end=2), op.Constant(value_ints=[1])))
    pos = op.Unsqueeze(
        op.Range(op.Constant(value_int=0), s_max, op.Constant(value_int=1)), op.Constant(value_ints=[0])
    )
    pos = op.Expand(
        pos, op.Concat(op.Shape(q, start=0, end=1), op.Reshape(s_max, op.Constant(value_ints=[1])), axis=0)
    )
    return score_positions(q, cache_flat, weights, row_map, req, pos, visible)


@script(glm5)
def indexer_logits_ragged(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k) -> FLOAT:
    """q [T, H_I, D_I], k_cache [rows, D_I], weights [T, H_I] fp32 -> [T, max(seqlens_k)] fp32.
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)"""
    row_map = ragged_row_map(seqlens_k, cu_seqlens_k)
    return indexer_logits_rows(q, k_cache, weights, cu_seqlens_q, seqlens_k, row_map)


@script(glm5)
def indexer_logits_paged(q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table) -> FLOAT:
    """As indexer_logits_ragged with a paged cache [nb, bs, D_I] and block_table [B, max_blocks].
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)"""
    row_map = paged_row_map(seqlens_k, block_table, k_cache)
    flat = op.Reshape(
        k_cache, op.Concat(op.Constant(value_ints=[-1]), op.Shape(k_cache, start=2, end=3), axis=0)
    )
    return indexer_logits_rows(q, flat, weights, cu_seqlens_q, seqlens_k, row_map)
