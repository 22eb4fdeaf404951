"""Sparse MLA attention in the absorbed form (SPEC 2.4): forward (out, lse) and backward (dq, dkv).

Forward grid: (T, cdiv(H, BLOCK_H)). One program owns one query token and BLOCK_H heads; it walks the token's
`topk` indices in chunks of BN, translates each valid logical position to a cache row in the kernel (ragged:
cu_seqlens_k[b] + j, paged: block_table[b, j // bs] * bs + j % bs), gathers those rows only (invalid indices
are masked loads: never read), and runs an online softmax. The latent row is split into its value part
[0, d_v) (BV = pow2 >= d_v columns) and the rest [d_v, d_qk) (BR columns): scores = q_v k_v^T + q_r k_r^T,
out accumulates p k_v. Empty rows keep m = -inf, l = 0 and give out 0, lse -inf; lse is natural-log.

Backward grid: the same. It recomputes p = exp(s - lse) and with delta = rowsum(dout * out):
ds = p * (dout k_v^T - delta + dlse), dq = sm_scale * ds k, dkv_v += sm_scale * ds^T q_v + p^T dout,
dkv_r += sm_scale * ds^T q_r. dq is owned by its program (deterministic); dkv rows are shared between
queries and are accumulated with fp32 atomic adds into an fp32 buffer: the summation order depends on
scheduling on a GPU (not run-to-run bitwise), exact in the interpreter (programs run in order).

Numerics vs the fp32 reference: fp32 accumulation everywhere; fp32 inputs use IEEE fp32 dots (no tf32);
fp16/bf16 inputs round p (and ds in the backward) to the input dtype before the tensor-core dots, as
FlashAttention / FlashMLA do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._indexer_score import cache_rows
from kernels_cuda._launches import count_launch, interpreter_active


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gather(
    kv_ptr,
    j,
    valid,
    b,
    cuk_ptr,
    bt_ptr,
    bt_stride,
    block_size,
    DQK,
    DV,
    PAGED: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
    HAS_R: tl.constexpr,
):
    """Rows of the valid logical positions j [BN]: (value part [BN, BV], rest [BN, BR], rows int64 [BN])."""
    rows = cache_rows(j, valid, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED)
    dv = tl.arange(0, BV)
    kv_v = tl.load(
        kv_ptr + rows[:, None] * DQK + dv[None, :], mask=valid[:, None] & (dv[None, :] < DV), other=0.0
    )
    kv_r = tl.zeros((j.shape[0], BR), kv_v.dtype)
    if HAS_R:
        dr = tl.arange(0, BR)
        kv_r = tl.load(
            kv_ptr + rows[:, None] * DQK + DV + dr[None, :],
            mask=valid[:, None] & (dr[None, :] < DQK - DV),
            other=0.0,
        )
    return kv_v, kv_r, rows


@triton.jit
def _load_heads(ptr, st, sh, t, h, hmask, col0, ncol, BC: tl.constexpr):
    c = tl.arange(0, BC)
    return tl.load(
        ptr + t.to(tl.int64) * st + h[:, None] * sh + col0 + c[None, :],
        mask=hmask[:, None] & (c[None, :] < ncol),
        other=0.0,
    )


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr,
    sq_t,
    sq_h,
    kv_ptr,
    idx_ptr,
    si_t,
    out_ptr,
    so_t,
    so_h,
    lse_ptr,
    req_ptr,
    seqk_ptr,
    cuk_ptr,
    bt_ptr,
    bt_stride,
    block_size,
    sm_scale,
    H,
    DQK,
    DV,
    NIDX,
    PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BN: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
    HAS_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    b = tl.load(req_ptr + t)
    s_b = tl.load(seqk_ptr + b)
    q_v = _load_heads(q_ptr, sq_t, sq_h, t, h, hmask, 0, DV, BV)
    q_r = tl.zeros((BLOCK_H, BR), q_v.dtype)
    if HAS_R:
        q_r = _load_heads(q_ptr, sq_t, sq_h, t, h, hmask, DV, DQK - DV, BR)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BV), tl.float32)
    for n0 in range(0, NIDX, BN):
        n = n0 + tl.arange(0, BN)
        j = tl.load(idx_ptr + t.to(tl.int64) * si_t + n, mask=n < NIDX, other=-1)
        valid = (j >= 0) & (j < s_b)
        kv_v, kv_r, rows = _gather(
            kv_ptr, j, valid, b, cuk_ptr, bt_ptr, bt_stride, block_size, DQK, DV, PAGED, BV, BR, HAS_R
        )
        s = _dot(q_v, tl.trans(kv_v), IEEE)
        if HAS_R:
            s += _dot(q_r, tl.trans(kv_r), IEEE)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp() at 0, not NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(kv_v.dtype), kv_v, IEEE)
        m = m_new
    has = l_sum > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    dv = tl.arange(0, BV)
    tl.store(
        out_ptr + t.to(tl.int64) * so_t + h[:, None] * so_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & (dv[None, :] < DV),
    )
    tl.store(lse_ptr + t.to(tl.int64) * H + h, lse, mask=hmask)


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr,
    sq_t,
    sq_h,
    kv_ptr,
    idx_ptr,
    si_t,
    out_ptr,
    do_ptr,
    so_t,
    so_h,
    lse_ptr,
    dlse_ptr,
    dq_ptr,
    dkv_ptr,
    req_ptr,
    seqk_ptr,
    cuk_ptr,
    bt_ptr,
    bt_stride,
    block_size,
    sm_scale,
    H,
    DQK,
    DV,
    NIDX,
    PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BN: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
    HAS_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    b = tl.load(req_ptr + t)
    s_b = tl.load(seqk_ptr + b)
    q_v = _load_heads(q_ptr, sq_t, sq_h, t, h, hmask, 0, DV, BV)
    q_r = tl.zeros((BLOCK_H, BR), q_v.dtype)
    if HAS_R:
        q_r = _load_heads(q_ptr, sq_t, sq_h, t, h, hmask, DV, DQK - DV, BR)
    d_out = _load_heads(do_ptr, so_t, so_h, t, h, hmask, 0, DV, BV)
    o = _load_heads(out_ptr, so_t, so_h, t, h, hmask, 0, DV, BV)
    lse = tl.load(lse_ptr + t.to(tl.int64) * H + h, mask=hmask, other=float("-inf"))
    dlse = tl.load(dlse_ptr + t.to(tl.int64) * H + h, mask=hmask, other=0.0)
    has = lse > float("-inf")
    lse_safe = tl.where(has, lse, 0.0)
    # delta - dlse: d lse / d s_j = p_j, so an lse gradient enters ds like -delta does
    delta = tl.sum(d_out.to(tl.float32) * o.to(tl.float32), axis=1) - dlse
    dq_v = tl.zeros((BLOCK_H, BV), tl.float32)
    dq_r = tl.zeros((BLOCK_H, BR), tl.float32)
    dv = tl.arange(0, BV)
    dr = tl.arange(0, BR)
    for n0 in range(0, NIDX, BN):
        n = n0 + tl.arange(0, BN)
        j = tl.load(idx_ptr + t.to(tl.int64) * si_t + n, mask=n < NIDX, other=-1)
        valid = (j >= 0) & (j < s_b)
        kv_v, kv_r, rows = _gather(
            kv_ptr, j, valid, b, cuk_ptr, bt_ptr, bt_stride, block_size, DQK, DV, PAGED, BV, BR, HAS_R
        )
        s = _dot(q_v, tl.trans(kv_v), IEEE)
        if HAS_R:
            s += _dot(q_r, tl.trans(kv_r), IEEE)
        live = valid[None, :] & has[:, None] & hmask[:, None]
        p = tl.where(live, tl.exp(s * sm_scale - lse_safe[:, None]), 0.0)
        dp = _dot(d_out, tl.trans(kv_v), IEEE)
        ds = p * (dp - delta[:, None])
        ds_c = ds.to(kv_v.dtype)
        dq_v += _dot(ds_c, kv_v, IEEE)
        dkv_v = sm_scale * _dot(tl.trans(ds_c), q_v, IEEE) + _dot(tl.trans(p.to(kv_v.dtype)), d_out, IEEE)
        tl.atomic_add(
            dkv_ptr + rows[:, None] * DQK + dv[None, :], dkv_v, mask=valid[:, None] & (dv[None, :] < DV)
        )
        if HAS_R:
            dq_r += _dot(ds_c, kv_r, IEEE)
            dkv_r = sm_scale * _dot(tl.trans(ds_c), q_r, IEEE)
            tl.atomic_add(
                dkv_ptr + rows[:, None] * DQK + DV + dr[None, :],
                dkv_r,
                mask=valid[:, None] & (dr[None, :] < DQK - DV),
            )
    base = dq_ptr + t.to(tl.int64) * sq_t + h[:, None] * sq_h
    tl.store(
        base + dv[None, :],
        (dq_v * sm_scale).to(dq_ptr.dtype.element_ty),
        mask=hmask[:, None] & (dv[None, :] < DV),
    )
    if HAS_R:
        tl.store(
            base + DV + dr[None, :],
            (dq_r * sm_scale).to(dq_ptr.dtype.element_ty),
            mask=hmask[:, None] & (dr[None, :] < DQK - DV),
        )


def _launch_args(q, kv_cache, d_v, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, backward=False):
    t, h, d_qk = q.shape
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    req = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=q.device, dtype=torch.int32), q_lens, output_size=t
    )
    paged = block_table is not None
    meta = block_table if paged else cu_seqlens_k
    bv = max(16, triton.next_power_of_2(d_v))
    br = max(16, triton.next_power_of_2(max(d_qk - d_v, 1)))
    # register budget: the fp32 [BLOCK_H, BV] accumulator(s) and the bf16 q / dout tiles live in registers
    # (GLM-5: BV = 512), so wide rows take fewer heads per program; the backward holds twice as much
    wide = bv >= 256
    block_h = min((16 if backward else 32) if wide else 64, max(16, triton.next_power_of_2(h)))
    bn = 32
    if interpreter_active():
        block_h, bn = 16, 16
    grid = (t, triton.cdiv(h, block_h))
    layout_args = (
        req,
        seqlens_k,
        meta,
        meta,
        block_table.stride(0) if paged else 0,
        kv_cache.shape[1] if paged else 0,
    )
    meta_kw = dict(
        PAGED=paged,
        BLOCK_H=block_h,
        BN=bn,
        BV=bv,
        BR=br,
        HAS_R=d_qk > d_v,
        IEEE=q.dtype == torch.float32,
        num_warps=8 if wide else 4,
        num_stages=2 if wide else 3,
    )
    return grid, layout_args, meta_kw


def sparse_mla_fwd(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, d_qk]; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk] (dtype of q);
    indices: int32 [T, topk] logical positions; layout tensors int32 as in SPEC 1.
    Returns (out [T, H, d_v] dtype of q, lse [T, H] float32).
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
    """
    t, h, d_qk = q.shape
    out = torch.empty((t, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if t == 0 or h == 0:
        return out, lse
    q, kv_cache, indices = q.contiguous(), kv_cache.contiguous(), indices.contiguous()
    lay = (cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table)
    grid, layout_args, meta_kw = _launch_args(q, kv_cache, d_v, *lay)
    count_launch("sparse_mla_fwd")
    _sparse_mla_fwd_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache,
        indices,
        indices.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        lse,
        *layout_args,
        float(sm_scale),
        h,
        d_qk,
        d_v,
        indices.shape[1],
        **meta_kw,
    )
    return out, lse


def sparse_mla_bwd(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `sparse_mla_fwd`: d_out [T, H, d_v], d_lse [T, H] or None -> (dq like q, dkv like
    kv_cache).
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4; autograd of the forward)
    """
    t, h, d_qk = q.shape
    q, kv_cache, indices = q.contiguous(), kv_cache.contiguous(), indices.contiguous()
    dq = torch.zeros_like(q)
    dkv = torch.zeros(kv_cache.shape, dtype=torch.float32, device=kv_cache.device)
    if t == 0 or h == 0:
        return dq, dkv.to(kv_cache.dtype)
    out, d_out = out.contiguous(), d_out.to(out.dtype).contiguous()
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.float().contiguous()
    lay = (cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table)
    grid, layout_args, meta_kw = _launch_args(q, kv_cache, d_v, *lay, backward=True)
    count_launch("sparse_mla_bwd")
    _sparse_mla_bwd_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache,
        indices,
        indices.stride(0),
        out,
        d_out,
        out.stride(0),
        out.stride(1),
        lse.contiguous(),
        d_lse,
        dq,
        dkv,
        *layout_args,
        float(sm_scale),
        h,
        d_qk,
        d_v,
        indices.shape[1],
        **meta_kw,
    )
    return dq, dkv.to(kv_cache.dtype)
