"""Fused lightning indexer + deterministic top-k (SPEC 2.2): never materialises the [T, S] logits.

Grid: one program per tile of BLOCK_T consecutive queries of one request. It streams the request's keys in
tiles of BS logical positions up to the tile's causal bound, scores them in registers
(kernels_cuda/_indexer_score.py) and feeds each query's causal scores into a running per-query top-k
(kernels_cuda/_select.py: threshold filter, append in position order, exact compaction when the buffer could
overflow). The end sorts each query's kept entries by (logit desc, position asc) and writes int32 logical
positions, -1 past the query's causal keys. Scratch: T * CAP * 8 bytes, CAP = pow2 >= topk + BS
(O(T * topk), as SPEC 2.2 asks). Paged caches are read through the block table in the kernel.

Numerics: logits as kernels_cuda/indexer_logits.py (fp32, rounding-level differences to the reference);
the selection is exact and deterministic for the logits this kernel computes, so an index can differ from
the reference only where two logits are within rounding of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._indexer_score import (
    block_shapes,
    cache_rows,
    load_queries,
    query_tiles,
    score_tile,
    tile_queries,
)
from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda._select import NO_THRESHOLD, append, buffer_slots, compact, order_key, sorted_columns

#: largest topk served (the final sort holds topk int64 composites per query in one program)
MAX_TOPK = 8192


@triton.jit
def _indexer_topk_kernel(
    q_ptr,
    sq_t,
    sq_h,
    k_ptr,
    ks_ptr,
    w_ptr,
    sw_t,
    out_ptr,
    topk,
    tiles_ptr,
    cuq_ptr,
    seqk_ptr,
    cuk_ptr,
    bt_ptr,
    bt_stride,
    block_size,
    skey_ptr,
    scol_ptr,
    H,
    D,
    PAGED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HP: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KSCALE: tl.constexpr,
):
    b, t, tmask, vis, vis_max = tile_queries(tiles_ptr, cuq_ptr, seqk_ptr, BLOCK_T)
    q, w = load_queries(q_ptr, sq_t, sq_h, w_ptr, sw_t, t, tmask, H, D, BLOCK_T, HP, BD)
    row_off = t.to(tl.int64) * CAP
    count = tl.zeros([BLOCK_T], tl.int32)
    thr = tl.full([BLOCK_T], NO_THRESHOLD, tl.int64)
    for s0 in range(0, vis_max, BS):
        pos = s0 + tl.arange(0, BS)
        pmask = pos < vis_max
        rows = cache_rows(pos, pmask, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED)
        scores = score_tile(q, w, k_ptr, rows, pmask, D, BLOCK_T, HP, BD, BS, IEEE)
        if KSCALE:  # FP8 keys: one fp32 scale per key, after the head sum (SPEC 7.4)
            scores = scores * tl.load(ks_ptr + rows, mask=pmask, other=0.0)[None, :]
        cand = pos[None, :] < vis[:, None]
        if tl.max(count, axis=0) > CAP - BS:
            count, thr = compact(skey_ptr, scol_ptr, row_off, count, thr, topk, CAP)
        col = pos[None, :] + tl.zeros([BLOCK_T, BS], tl.int32)
        count = append(skey_ptr, scol_ptr, row_off, count, thr, order_key(scores), col, cand, CAP)
    if tl.max(count, axis=0) > topk:
        count, thr = compact(skey_ptr, scol_ptr, row_off, count, thr, topk, CAP)
    col = sorted_columns(skey_ptr, scol_ptr, row_off, count, BLOCK_K)
    slot = tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + t.to(tl.int64)[:, None] * topk + slot[None, :],
        col,
        mask=tmask[:, None] & (slot[None, :] < topk),
    )


def indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    topk: int,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H_I, D_I]; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I] (dtype of q);
    weights: [T, H_I] fp32;
    layout tensors as `kernels_cuda.indexer_logits.indexer_logits`; 1 <= topk <= MAX_TOPK.
    k_scale: FP8 keys (q and k_cache e4m3) with one fp32 scale per cache row, ragged [rows] / paged
    [nb, bs]: the logits of SPEC 7.4, selected the same way (kernels_cuda.fp8_indexer).
    Returns int32 [T, topk] logical positions in rule order, -1 past the causal keys.
    Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
    """
    t, h_i, d_i = q.shape
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    if t == 0:
        return out
    q, k_cache, weights = q.contiguous(), k_cache.contiguous(), weights.contiguous()
    hp, bd, block_t = block_shapes(h_i, d_i, interpreter_active())
    fp8 = k_scale is not None
    if fp8:
        bd = max(bd, 32)  # fp8 MMA needs K >= 32
        k_scale = k_scale.contiguous()
    bs = 16 if interpreter_active() else 64
    block_k, cap = buffer_slots(topk, bs)
    skey = torch.empty((t, cap), dtype=torch.int32, device=q.device)
    scol = torch.empty((t, cap), dtype=torch.int32, device=q.device)
    tiles = query_tiles(cu_seqlens_q, t, block_t)
    paged = block_table is not None
    meta = block_table if paged else cu_seqlens_k
    count_launch("fp8_indexer_topk" if fp8 else "indexer_topk")
    _indexer_topk_kernel[(tiles.shape[0],)](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        k_scale if fp8 else weights,
        weights,
        weights.stride(0),
        out,
        topk,
        tiles,
        cu_seqlens_q,
        seqlens_k,
        meta,
        meta,
        block_table.stride(0) if paged else 0,
        k_cache.shape[1] if paged else 0,
        skey,
        scol,
        h_i,
        d_i,
        PAGED=paged,
        BLOCK_T=block_t,
        HP=hp,
        BD=bd,
        BS=bs,
        IEEE=q.dtype == torch.float32,
        CAP=cap,
        BLOCK_K=block_k,
        KSCALE=fp8,
        num_warps=8 if block_k >= 2048 else 4,
    )
    return out
