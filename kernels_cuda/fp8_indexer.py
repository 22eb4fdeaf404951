"""FP8 lightning-indexer logits and top-k (SPEC 7.4, 7.5): e4m3 queries against an e4m3 key cache with
one fp32 scale per key (DeepSeek-V3.2 `fp8_index`, DeepGEMM `fp8_mqa_logits` / `fp8_paged_mqa_logits`).

Same tiling as kernels_cuda/indexer_logits.py (kernels_cuda/_indexer_score.py: a tile's (query, head)
rows are the M side of one dot, keys read through the layout in the kernel), with an fp8 dot:
    dots = tl.dot(q8 [BLOCK_T*HP, BD], k8^T [BD, BS]) -> fp32 (e4m3 x e4m3 on sm_89+; exact products
           summed in fp32 under the interpreter),
    logits = k_scale[row] * sum_h weights[t, h] * relu(dots)          (scale after the head sum, as fp8_index)
-inf where not causal. fp32 results agree with the fp64 reference to rounding, not bitwise.
Top-k: the fused kernel of kernels_cuda/indexer_topk.py scores the same way (the per-key scale after the
head sum) into its running per-query top-k, so the [T, S] logits are never materialised: scratch is
O(T * topk), as for the bf16 indexer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._indexer_score import block_shapes, cache_rows, load_queries, query_tiles, tile_queries
from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.indexer_topk import indexer_topk as _fused_topk


@triton.jit
def _fp8_indexer_logits_kernel(
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
):
    b, t, tmask, vis, vis_max = tile_queries(tiles_ptr, cuq_ptr, seqk_ptr, BLOCK_T)
    pos = tl.program_id(1) * BS + tl.arange(0, BS)
    scores = tl.full((BLOCK_T, BS), float("-inf"), tl.float32)
    if tl.program_id(1) * BS < vis_max:
        pmask = pos < vis_max
        rows = cache_rows(pos, pmask, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED)
        q, w = load_queries(q_ptr, sq_t, sq_h, w_ptr, sw_t, t, tmask, H, D, BLOCK_T, HP, BD)
        d = tl.arange(0, BD)
        key = tl.load(
            k_ptr + rows[:, None] * D + d[None, :], mask=pmask[:, None] & (d[None, :] < D), other=0.0
        )
        dots = tl.dot(q, tl.trans(key), out_dtype=tl.float32)
        dots = tl.reshape(tl.maximum(dots, 0.0), (BLOCK_T, HP, BS))
        ks = tl.load(ks_ptr + rows, mask=pmask, other=0.0)
        scores = tl.sum(dots * w[:, :, None], axis=1) * ks[None, :]
        scores = tl.where(pos[None, :] < vis[:, None], scores, float("-inf"))
    tl.store(
        out_ptr + t.to(tl.int64)[:, None] * s_max + pos[None, :],
        scores,
        mask=tmask[:, None] & (pos[None, :] < s_max),
    )


def fp8_indexer_logits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    s_max: int,
) -> torch.Tensor:
    """q e4m3 [T, H_I, D_I]; k_cache e4m3 ragged [rows, D_I] / paged [nb, bs, D_I]; k_scale fp32 [rows] /
    [nb, bs]; weights fp32 [T, H_I] -> [T, s_max] fp32.
    Semantics: backends/reference/fp8_indexer_logits.py"""
    t, h_i, d_i = q.shape
    out = torch.empty((t, s_max), dtype=torch.float32, device=q.device)
    if t == 0 or s_max == 0:
        return out
    q, k_cache, k_scale, weights = (
        q.contiguous(),
        k_cache.contiguous(),
        k_scale.contiguous(),
        weights.contiguous(),
    )
    hp, bd, block_t = block_shapes(h_i, d_i, interpreter_active())
    bd = max(bd, 32)  # fp8 MMA needs K >= 32
    bs = 16 if interpreter_active() else 64
    tiles = query_tiles(cu_seqlens_q, t, block_t)
    paged = block_table is not None
    meta = block_table if paged else cu_seqlens_k
    count_launch("fp8_indexer_logits")
    _fp8_indexer_logits_kernel[(tiles.shape[0], triton.cdiv(s_max, bs))](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        k_scale,
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
        k_cache.shape[1] if paged else 0,
        h_i,
        d_i,
        PAGED=paged,
        BLOCK_T=block_t,
        HP=hp,
        BD=bd,
        BS=bs,
        num_warps=4,
    )
    return out


def fp8_indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> torch.Tensor:
    """int32 [T, topk]: the rule's top-k of `fp8_indexer_logits` over each query's causal keys, -1 after,
    fused (the logits are never materialised: kernels_cuda.indexer_topk with the per-key scale).
    Semantics: backends/reference/fp8_indexer_topk.py (SPEC 7.5)"""
    return _fused_topk(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, topk, k_scale)
