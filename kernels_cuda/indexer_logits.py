"""Lightning-indexer logits (SPEC 2.1) as one Triton kernel: logits[t, j] for every key column of S_max.

Grid (query tiles, key tiles of BS columns). One program scores BLOCK_T consecutive queries of one request
against BS logical key positions (kernels_cuda/_indexer_score.py: one tensor-core dot over the
(query, head) rows, relu, head-weighted sum in fp32) and writes -inf where the key is not causal for the
query or past the request's keys. Keys past the tile's causal bound are never read.

Numerics: fp32 accumulation as the reference; the dot's reduction order over D_I and the head sum order
differ from the reference's einsum, so fp32 results agree to rounding, not bitwise.
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


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    sq_t,
    sq_h,
    k_ptr,
    ks_ptr,
    w_ptr,
    sw_t,
    out_ptr,
    s_max,
    tiles_ptr,
    cuq_ptr,
    seqk_ptr,
    cuk_ptr,
    bt_ptr,
    bt_stride,
    block_size,
    H,
    D,
    PAGED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HP: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
    KSCALE: tl.constexpr,
):
    b, t, tmask, vis, vis_max = tile_queries(tiles_ptr, cuq_ptr, seqk_ptr, BLOCK_T)
    pos = tl.program_id(1) * BS + tl.arange(0, BS)
    scores = tl.full((BLOCK_T, BS), float("-inf"), tl.float32)
    if tl.program_id(1) * BS < vis_max:
        pmask = pos < vis_max
        rows = cache_rows(pos, pmask, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED)
        q, w = load_queries(q_ptr, sq_t, sq_h, w_ptr, sw_t, t, tmask, H, D, BLOCK_T, HP, BD)
        scores = score_tile(q, w, k_ptr, rows, pmask, D, BLOCK_T, HP, BD, BS, IEEE)
        if KSCALE:  # FP8 keys: one fp32 scale per key, after the head sum (SPEC 7.4)
            scores = scores * tl.load(ks_ptr + rows, mask=pmask, other=0.0)[None, :]
        scores = tl.where(pos[None, :] < vis[:, None], scores, float("-inf"))
    tl.store(
        out_ptr + t.to(tl.int64)[:, None] * s_max + pos[None, :],
        scores,
        mask=tmask[:, None] & (pos[None, :] < s_max),
    )


def indexer_logits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    s_max: int,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H_I, D_I]; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I] (dtype of q);
    weights: [T, H_I] fp32; cu_seqlens_q [B+1], seqlens_k [B], exactly one of cu_seqlens_k [B+1] /
    block_table [B, max_blocks] (int32);
    s_max: max(seqlens_k) (a host int: the output's width); k_scale: FP8 keys (q and k_cache e4m3) with one
    fp32 scale per cache row, ragged [rows] / paged [nb, bs] (SPEC 7.4, kernels_cuda.fp8_indexer).
    Returns [T, s_max] float32.
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
    """
    t, h_i, d_i = q.shape
    out = torch.empty((t, s_max), dtype=torch.float32, device=q.device)
    if t == 0 or s_max == 0:
        return out
    q, k_cache, weights = q.contiguous(), k_cache.contiguous(), weights.contiguous()
    hp, bd, block_t = block_shapes(h_i, d_i, interpreter_active())
    fp8 = k_scale is not None
    if fp8:
        bd = max(bd, 32)  # fp8 MMA needs K >= 32
        k_scale = k_scale.contiguous()
    bs = 64
    tiles = query_tiles(cu_seqlens_q, t, block_t)
    paged = block_table is not None
    block_size = k_cache.shape[1] if paged else 0
    meta = block_table if paged else cu_seqlens_k
    count_launch("fp8_indexer_logits" if fp8 else "indexer_logits")
    _indexer_logits_kernel[(tiles.shape[0], triton.cdiv(s_max, bs))](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        k_scale if fp8 else weights,
        weights,
        weights.stride(0),
        out,
        s_max,
        tiles,
        cu_seqlens_q,
        seqlens_k,
        meta,
        meta,
        block_table.stride(0) if paged else 0,
        block_size,
        h_i,
        d_i,
        PAGED=paged,
        BLOCK_T=block_t,
        HP=hp,
        BD=bd,
        BS=bs,
        IEEE=q.dtype == torch.float32,
        KSCALE=fp8,
        num_warps=4,
    )
    return out
