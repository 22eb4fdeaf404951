"""FP8 block-scaled GEMMs (SPEC 7.2, 7.3): e4m3 activations in 1 x 128 groups, e4m3 weights in 128 x 128
blocks, fp32 accumulation promoted once per 128-wide K block, as DeepGEMM and DeepSeek's `fp8_gemm`.

`fp8_block_tile` walks K in steps of exactly 128: one `tl.dot(e4m3, e4m3) -> fp32` per K block (on
sm_90 the wgmma accumulator inside a block keeps ~14 bits, as DeepGEMM's; under the interpreter the
products are exact and summed in fp32), then `acc += (d * x_scale[m, kb]) * w_scale_inv[n // 128, kb]`
in the fp32 accumulator; bf16 outputs are rounded to nearest even explicitly (`rne_bf16`). Partial
last K / N / M blocks are masked loads of zero (e4m3 0x00 == 0).
One fixed tile per build so a row never depends on how many rows share the launch (batch invariance).
The grouped variant numbers the M-tiles of all experts with kernels_cuda.grouped_matmul.tile_schedule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.fp8_quant import rne_bf16
from kernels_cuda.grouped_matmul import tile_schedule
from kernels_cuda.w8a8_matmul import TL_DTYPES

BLOCK_K = 128


@triton.jit
def fp8_block_tile(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    rm,
    rn,
    mask_m,
    mask_n,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_xsm,
    stride_wsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N]: the promoted sum over K blocks of x[rm] . w[rn]^T."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + rk
        mask_k = kk < K
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        d = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(xs_ptr + rm * stride_xsm + kb, mask=mask_m, other=0.0)
        sb = tl.load(ws_ptr + (rn // 128) * stride_wsn + kb, mask=mask_n, other=0.0)
        acc += (d * sa[:, None]) * sb[None, :]
    return acc


@triton.jit
def _fp8_matmul_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_xsm,
    stride_wsn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    acc = fp8_block_tile(
        x_ptr,
        xs_ptr,
        w_ptr,
        ws_ptr,
        rm,
        rn,
        mask_m,
        mask_n,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_xsm,
        stride_wsn,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if OUT_DTYPE == tl.bfloat16:
        acc = rne_bf16(acc)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(OUT_DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _fp8_grouped_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    offs_ptr,
    tile_expert_ptr,
    tile_first_ptr,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_xsm,
    stride_wse,
    stride_wsn,
    stride_om,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e >= E:
        return
    row_lo = tl.load(offs_ptr + e).to(tl.int64) + (tile - tl.load(tile_first_ptr + e)).to(tl.int64) * BLOCK_M
    rm = row_lo + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < tl.load(offs_ptr + e + 1).to(tl.int64)
    mask_n = rn < N
    e64 = e.to(tl.int64)
    acc = fp8_block_tile(
        x_ptr,
        xs_ptr,
        w_ptr + e64 * stride_we,
        ws_ptr + e64 * stride_wse,
        rm,
        rn,
        mask_m,
        mask_n,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_xsm,
        stride_wsn,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if OUT_DTYPE == tl.bfloat16:
        acc = rne_bf16(acc)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(OUT_DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _config() -> tuple[int, int, dict]:
    if interpreter_active():
        return 32, 128, {}
    return 64, 128, dict(num_warps=4, num_stages=3)


def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3 [N, K], w_scale_inv fp32
    [ceil(N/128), ceil(K/128)] -> [M, N] out_dtype.  Semantics: backends/reference/fp8_block_matmul.py"""
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    bm, bn, extra = _config()
    xs, ws = x_scale.contiguous(), w_scale_inv.contiguous()
    _fp8_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x_q,
        xs,
        w_q,
        ws,
        bias if bias is not None else xs,
        out,
        m,
        n,
        k,
        x_q.stride(0),
        x_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        xs.stride(0),
        ws.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        OUT_DTYPE=TL_DTYPES[out_dtype],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=BLOCK_K,
        **extra,
    )
    count_launch("fp8_block_matmul")
    return out


def fp8_grouped_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x_q e4m3 [M, K] expert-sorted, w_q e4m3 [E, N, K], w_scale_inv [E, ceil(N/128), ceil(K/128)]:
    one launch for all experts; rows past the last offset get no tile and stay zero (SPEC 2.8's padding).
    Semantics: backends/reference/fp8_grouped_matmul.py (SPEC 7.3)"""
    m, k = x_q.shape
    e, n = w_q.shape[0], w_q.shape[1]
    out = torch.zeros((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    bm, bn, extra = _config()
    offs, tile_expert, tile_first, t_max = tile_schedule(group_offsets, m, bm)
    xs, ws = x_scale.contiguous(), w_scale_inv.contiguous()
    _fp8_grouped_kernel[(t_max, triton.cdiv(n, bn))](
        x_q,
        xs,
        w_q,
        ws,
        out,
        offs,
        tile_expert,
        tile_first,
        n,
        k,
        e,
        x_q.stride(0),
        x_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        w_q.stride(2),
        xs.stride(0),
        ws.stride(0),
        ws.stride(1),
        out.stride(0),
        OUT_DTYPE=TL_DTYPES[out_dtype],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=BLOCK_K,
        **extra,
    )
    count_launch("fp8_grouped_matmul")
    return out
