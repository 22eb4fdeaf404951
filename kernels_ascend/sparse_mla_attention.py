"""Sparse MLA attention for Ascend (SPEC 2.4) for shapes npu_sparse_flash_attention does not take
(it fixes D = 512 + Dr = 64 and d_v = 512; head counts beyond the SoC's set).

One program per AI core loops over (token, head block) work items. For one item it streams the token's
index list in BLOCK_K tiles: the adapter has already turned logical positions into physical cache rows
(-1 = skip), so a tile is a row gather; scores = q . K^T accumulated over BLOCK_D chunks of d_qk on the
cube (fp32 operands), then an online softmax (running max m, running sum l) and acc += p . V with V the
rows' first d_v columns. Finally lse = m + log(l), out = acc / l; a row with no valid index gives
out = 0, lse = -inf. Rows no valid index names are never loaded (masked gathers), so NaN fill is harmless.
Tiles: q 16 x 64, K 32 x 64, V 32 x d_v, acc 16 x d_v fp32 (d_v <= 512: 32 KB): inside the UB.
Numerics: fp32 like the reference, but the online softmax rescales in a different order: fp32
reduction tolerance, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_H, BLOCK_K, BLOCK_D = 16, 32, 64


@triton.jit
def _sparse_attn_kernel(
    q_ptr,
    kv_ptr,
    rows_ptr,
    out_ptr,
    lse_ptr,
    T,
    H,
    D,
    DV,
    NIDX,
    sm_scale,
    items_per_prog,
    NPROG: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    DVP: tl.constexpr,
):
    pid = tl.program_id(0)
    hblocks = tl.cdiv(H, BH)
    oh0 = tl.arange(0, BH)
    odv = tl.arange(0, DVP)
    for it in range(0, items_per_prog):
        item = pid + it * NPROG
        if item < T * hblocks:
            t = item // hblocks
            oh = (item % hblocks) * BH + oh0
            mh = oh < H
            m = tl.full([BH], float("-inf"), dtype=tl.float32)
            l_sum = tl.zeros([BH], dtype=tl.float32)
            acc = tl.zeros([BH, DVP], dtype=tl.float32)
            for j0 in range(0, NIDX, BK):
                oj = j0 + tl.arange(0, BK)
                rows = tl.load(rows_ptr + t * NIDX + oj, mask=oj < NIDX, other=-1)
                ok = rows >= 0
                r64 = tl.where(ok, rows, 0).to(tl.int64)
                s = tl.zeros([BH, BK], dtype=tl.float32)
                for d0 in range(0, D, BD):
                    od = d0 + tl.arange(0, BD)
                    md = od < D
                    qd = tl.load(
                        q_ptr + t * H * D + oh[:, None] * D + od[None, :],
                        mask=mh[:, None] & md[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    kd = tl.load(
                        kv_ptr + r64[:, None] * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0
                    ).to(tl.float32)
                    s += tl.dot(qd, tl.trans(kd))
                s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep zeros
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                v = tl.load(
                    kv_ptr + r64[:, None] * D + odv[None, :],
                    mask=ok[:, None] & (odv[None, :] < DV),
                    other=0.0,
                ).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v)
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
                m = m_new
            empty = l_sum == 0.0
            out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_sum)[:, None])
            lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l_sum)))
            tl.store(
                out_ptr + t * H * DV + oh[:, None] * DV + odv[None, :],
                out,
                mask=mh[:, None] & (odv[None, :] < DV),
            )
            tl.store(lse_ptr + t * H + oh, lse, mask=mh)


def sparse_mla_attention(
    q: torch.Tensor, kv_rows: torch.Tensor, rows: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, d_qk] float; kv_rows: [rows, d_qk] (the cache flattened to rows); rows: int32 [T, topk]
    physical row of each index, -1 to skip. Returns (out [T, H, d_v] q.dtype, lse [T, H] fp32).
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)"""
    t, h, d = q.shape
    out = torch.zeros((t, h, d_v), dtype=torch.float32, device=q.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device)
    if t and h:
        items = t * triton.cdiv(h, BLOCK_H)
        nprog = min(num_cores("aicore"), items)
        _sparse_attn_kernel[(nprog,)](
            q.contiguous(),
            kv_rows.contiguous(),
            rows.contiguous(),
            out,
            lse,
            t,
            h,
            d,
            d_v,
            rows.shape[1],
            float(sm_scale),
            triton.cdiv(items, nprog),
            NPROG=nprog,
            BH=BLOCK_H,
            BK=BLOCK_K,
            BD=BLOCK_D,
            DVP=max(16, triton.next_power_of_2(d_v)),
        )
        count_launch("sparse_mla_attention")
    # the cast to q.dtype is torch's round-to-nearest-even (the interpreter's in-kernel cast truncates)
    return out.to(q.dtype), lse
