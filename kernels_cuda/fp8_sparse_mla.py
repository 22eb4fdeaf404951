"""Sparse MLA attention on FlashMLA's V3.2 FP8 latent cache (SPEC 7.7), forward only.

Same schedule as kernels_cuda/sparse_mla_attention.py (one program = one query token x BLOCK_H heads,
the token's indices in chunks of BN, online softmax, only rows named by a valid index are read), but a
row is 656 bytes: the kernel reads the 512 e4m3 latent values, the 4 fp32 tile scales and the 64 bf16
RoPE values through three typed views of the same bytes and de-quantizes in registers as FlashMLA's SM90
kernel does: latent = bf16(float(fp8) * bf16(scale)) (`rne_bf16`, exact for power-of-two scales).
Dots run in bf16 with fp32 accumulation for bf16 q (p rounded to bf16 before the PV dot, as FlashMLA),
in IEEE fp32 for fp32 q. Under the interpreter (NumPy has no bf16: its bf16 dot multiplies raw bits) the
bf16 path runs the same dots on fp32 copies of the bf16 values, which is the same arithmetic (bf16
products are exact in fp32), with p rounded by `rne_bf16`. Empty rows: out 0, lse -inf (natural log).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._indexer_score import cache_rows
from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.fp8_quant import rne_bf16


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fp8_sparse_mla_fwd_kernel(
    q_ptr,
    sq_t,
    sq_h,
    lat_ptr,
    sc_ptr,
    rope_ptr,
    s_lat,
    s_sc,
    s_rope,
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
    NIDX,
    PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BN: tl.constexpr,
    IEEE: tl.constexpr,
    BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    b = tl.load(req_ptr + t)
    s_b = tl.load(seqk_ptr + b)
    dv = tl.arange(0, 512)
    dr = tl.arange(0, 64)
    qb = q_ptr + t.to(tl.int64) * sq_t + h[:, None] * sq_h
    q_v = tl.load(qb + dv[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(qb + 512 + dr[None, :], mask=hmask[:, None], other=0.0)
    if IEEE:
        q_v = q_v.to(tl.float32)
        q_r = q_r.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    for n0 in range(0, NIDX, BN):
        n = n0 + tl.arange(0, BN)
        j = tl.load(idx_ptr + t.to(tl.int64) * si_t + n, mask=n < NIDX, other=-1)
        valid = (j >= 0) & (j < s_b)
        rows = cache_rows(j, valid, b, cuk_ptr, bt_ptr, bt_stride, block_size, PAGED)
        codes = tl.load(lat_ptr + rows[:, None] * s_lat + dv[None, :], mask=valid[:, None], other=0.0)
        scale = tl.load(sc_ptr + rows[:, None] * s_sc + dv[None, :] // 128, mask=valid[:, None], other=0.0)
        kv_v = rne_bf16(codes.to(tl.float32) * rne_bf16(scale)).to(q_v.dtype)
        kv_r = tl.load(rope_ptr + rows[:, None] * s_rope + dr[None, :], mask=valid[:, None], other=0.0)
        kv_r = kv_r.to(q_v.dtype)  # bf16 values: exact in either dtype
        s = _dot(q_v, tl.trans(kv_v), IEEE) + _dot(q_r, tl.trans(kv_r), IEEE)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if BF16:
            p = rne_bf16(p)
        acc = acc * alpha[:, None] + _dot(p.to(kv_v.dtype), kv_v, IEEE)
        m = m_new
    has = l_sum > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    if BF16:
        out = rne_bf16(out)
    tl.store(
        out_ptr + t.to(tl.int64) * so_t + h[:, None] * so_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    tl.store(lse_ptr + t.to(tl.int64) * H + h, lse, mask=hmask)


def fp8_sparse_mla_fwd(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16/fp32 [T, H, 576]; kv_cache uint8 ragged [rows, 656] / paged [nb, bs, 656]; indices int32
    [T, topk] logical positions -> (out [T, H, 512] dtype of q, lse [T, H] fp32).
    Semantics: backends/reference/fp8_sparse_mla_attention.py (SPEC 7.7)"""
    t, h, _ = q.shape
    out = torch.empty((t, h, 512), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if t == 0 or h == 0:
        return out, lse
    q, indices = q.contiguous(), indices.contiguous()
    paged = block_table is not None
    flat = kv_cache.contiguous().view(-1, 656)
    lat = flat[:, :512].view(torch.float8_e4m3fn)
    sc = flat[:, 512:528].view(torch.float32)
    rope = flat[:, 528:].view(torch.bfloat16)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    req = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=q.device, dtype=torch.int32), q_lens, output_size=t
    )
    meta = block_table if paged else cu_seqlens_k
    block_h, bn = (16, 16) if interpreter_active() else (32, 32)
    extra = {} if interpreter_active() else dict(num_warps=8, num_stages=2)
    count_launch("fp8_sparse_mla_fwd")
    _fp8_sparse_mla_fwd_kernel[(t, triton.cdiv(h, block_h))](
        q,
        q.stride(0),
        q.stride(1),
        lat,
        sc,
        rope,
        lat.stride(0),
        sc.stride(0),
        rope.stride(0),
        indices,
        indices.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        lse,
        req,
        seqlens_k,
        meta,
        meta,
        block_table.stride(0) if paged else 0,
        kv_cache.shape[1] if paged else 0,
        float(sm_scale),
        h,
        indices.shape[1],
        PAGED=paged,
        BLOCK_H=block_h,
        BN=bn,
        IEEE=q.dtype == torch.float32 or interpreter_active(),
        BF16=q.dtype == torch.bfloat16,
        **extra,
    )
    return out, lse
