"""Lightning-indexer scoring of one [BLOCK_T queries x BS keys] tile, shared by `indexer_logits` and
`indexer_topk`, plus the per-request query tiling and the in-kernel cache-row lookup.

A tile's queries all belong to one request b. The BLOCK_T * HP (query, head) rows form the M side of one
tensor-core dot against BS keys: dots [BLOCK_T*HP, BS] = q [BLOCK_T*HP, BD] @ key^T [BD, BS] (fp32
accumulate; fp32 inputs use IEEE fp32, not tf32), then relu, then the head weights are applied and the
heads summed (fp32). Heads pad to HP = pow2 with zero q and zero weight, D_I pads to BD with zeros, so the
padding adds exact zeros. Keys are read through the layout in the kernel: ragged row cu_seqlens_k[b] + p,
paged row block_table[b, p // bs] * bs + p % bs; positions past the tile's causal bound are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cache_rows(pos, pmask, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED: tl.constexpr):
    """Physical rows (int64) of logical positions `pos` of request b; masked positions give row 0 (unread)."""
    if PAGED:
        blk = tl.load(bt_ptr + b * bt_stride + pos // block_size, mask=pmask, other=0).to(tl.int64)
        rows = blk * block_size + pos % block_size
    else:
        rows = tl.load(cuk_ptr + b).to(tl.int64) + pos
    return tl.where(pmask, rows, 0)


@triton.jit
def tile_queries(tiles_ptr, cuq_ptr, seqk_ptr, BLOCK_T: tl.constexpr):
    """(b, t [BLOCK_T] query rows, tmask, visible [BLOCK_T] causal key counts, max visible) of this tile."""
    pid = tl.program_id(0)
    b = tl.load(tiles_ptr + 2 * pid)
    t0 = tl.load(tiles_ptr + 2 * pid + 1)
    q_start = tl.load(cuq_ptr + b)
    q_end = tl.load(cuq_ptr + b + 1)
    s_b = tl.load(seqk_ptr + b)
    t = t0 + tl.arange(0, BLOCK_T)
    tmask = t < q_end
    # right-down causality: query i of T_b sees keys j <= S_b - T_b + i
    vis = tl.minimum(tl.maximum(s_b - (q_end - q_start) + (t - q_start) + 1, 0), s_b)
    vis = tl.where(tmask, vis, 0)
    return b, t, tmask, vis, tl.max(vis, axis=0)


@triton.jit
def load_queries(
    q_ptr, sq_t, sq_h, w_ptr, sw_t, t, tmask, H, D, BLOCK_T: tl.constexpr, HP: tl.constexpr, BD: tl.constexpr
):
    """q as [BLOCK_T*HP, BD] (row = query * HP + head) and weights [BLOCK_T, HP] fp32 (0 on padding)."""
    r = tl.arange(0, BLOCK_T * HP)
    rt = tl.min(t, axis=0) + r // HP  # the tile's queries are consecutive rows
    rh = r % HP
    d = tl.arange(0, BD)
    rmask = (rh < H) & tl.reshape(tl.broadcast_to(tmask[:, None], (BLOCK_T, HP)), (BLOCK_T * HP,))
    q = tl.load(
        q_ptr + rt.to(tl.int64)[:, None] * sq_t + rh[:, None] * sq_h + d[None, :],
        mask=rmask[:, None] & (d[None, :] < D),
        other=0.0,
    )
    h = tl.arange(0, HP)
    w = tl.load(
        w_ptr + t.to(tl.int64)[:, None] * sw_t + h[None, :], mask=tmask[:, None] & (h[None, :] < H), other=0.0
    )
    return q, w


@triton.jit
def score_tile(
    q,
    w,
    k_ptr,
    rows,
    pmask,
    D,
    BLOCK_T: tl.constexpr,
    HP: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Scores [BLOCK_T, BS] fp32 of the keys at physical `rows` [BS] (cache rows contiguous of width D)."""
    d = tl.arange(0, BD)
    key = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=pmask[:, None] & (d[None, :] < D), other=0.0)
    if q.dtype == tl.float8e4nv:
        # e4m3 -> fp16 is exact; Hopper's e4m3 tensor-core dot sums its products in a narrower accumulator
        # (relative error ~1e-4 at D_I = 128 on an H200, outside SPEC 7.4's tolerance), fp16's in fp32
        q = q.to(tl.float16)
        key = key.to(tl.float16)
    if IEEE:
        dots = tl.dot(q, tl.trans(key), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(key))
    dots = tl.reshape(tl.maximum(dots, 0.0), (BLOCK_T, HP, BS))
    return tl.sum(dots * w[:, :, None], axis=1)


def query_tiles(cu_seqlens_q: torch.Tensor, num_tokens: int, block_t: int) -> torch.Tensor:
    """[n, 2] int32 (request, first query row): each request's queries cut into tiles of block_t, computed
    on the device (no host read, so a CUDA graph can capture the launch). n = cdiv(T, block_t) + B is fixed
    by the shapes: the real tiles come first, the rest are (0, T), which select no query row and do nothing.
    """
    batch = cu_seqlens_q.shape[0] - 1
    cu = cu_seqlens_q.to(torch.int64)
    n_tiles = (cu[1:] - cu[:-1] + block_t - 1) // block_t
    tile_end = torch.cumsum(n_tiles, 0)
    j = torch.arange(triton.cdiv(num_tokens, block_t) + batch, device=cu.device)
    b = torch.searchsorted(tile_end, j, right=True).clamp(max=batch - 1)
    t0 = cu[b] + (j - (tile_end[b] - n_tiles[b])) * block_t
    real = j < tile_end[-1]
    return torch.stack([torch.where(real, b, 0), torch.where(real, t0, num_tokens)], 1).to(torch.int32)


def block_shapes(h_i: int, d_i: int, interpreted: bool) -> tuple[int, int, int]:
    """(HP, BD, BLOCK_T): padded heads, padded head dim, queries per tile (M = BLOCK_T * HP >= 16)."""
    hp = triton.next_power_of_2(h_i)
    bd = max(16, triton.next_power_of_2(d_i))
    block_t = max(1, (16 if interpreted else 128) // hp)
    return hp, bd, block_t
