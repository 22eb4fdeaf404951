"""MoE grouped GEMM over expert-sorted rows, one launch for all experts (SPEC 2.8).

Schedule: expert e owns rows group_offsets[e] : group_offsets[e+1] and ceil(rows_e / BLOCK_M) M-tiles;
`tile_schedule` numbers the tiles of all experts consecutively on the device (cumsum + searchsorted,
no host sync) into `tile_expert[t]` and `tile_first[e]` (index of expert e's first tile). The grid is
an upper bound on the tile count (min(M, ceil(M / BLOCK_M) + E)) times the N-tiles; a program whose
tile lies past the last expert returns at once. Empty experts own no tile. Each program computes a
BLOCK_M x BLOCK_N tile of one expert, masked at the expert's last row, so a row never depends on
another expert's rows or on its position inside its expert.

Variants (constexpr VARIANT), each with the numerics of the corresponding single-GEMM kernel:
  0 float: tl.dot with fp32 accumulation (IEEE fp32 products for fp32 inputs, never TF32), cast once;
  1 W8A8: kernels_cuda.w8a8_matmul.int8_tile + scale_epilogue (exact int32, reference epilogue order);
  2 W4A8: kernels_cuda.w4a8_matmul.w4a8_tile (in-kernel int4 unpack, fp32 group sum in group order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.w4a8_matmul import block_k_for, w4a8_tile
from kernels_cuda.w8a8_matmul import TL_DTYPES, int8_tile, scale_epilogue

FLOAT, W8A8, W4A8 = 0, 1, 2


@triton.jit
def float_tile(
    x_ptr,
    w_ptr,
    rm,
    rn,
    mask_m,
    mask_n,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = x[rm, :K] @ w[rn, :K]^T with fp32 accumulation."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
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
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_matmul_kernel(
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
    group_size,
    num_groups,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_om,
    VARIANT: tl.constexpr,
    PRECISION: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_IS_STEP: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e >= E:
        return
    row_lo = tl.load(offs_ptr + e).to(tl.int64) + (tile - tl.load(tile_first_ptr + e)).to(tl.int64) * BLOCK_M
    row_hi = tl.load(offs_ptr + e + 1).to(tl.int64)
    rm = row_lo + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < row_hi
    mask_n = rn < N
    w_e = w_ptr + e.to(tl.int64) * stride_we
    if VARIANT == 0:
        out = float_tile(
            x_ptr,
            w_e,
            rm,
            rn,
            mask_m,
            mask_n,
            K,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    elif VARIANT == 1:
        acc = int8_tile(
            x_ptr,
            w_e,
            rm,
            rn,
            mask_m,
            mask_n,
            K,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        ws = tl.load(ws_ptr + e.to(tl.int64) * stride_se + rn * stride_sn, mask=mask_n, other=0.0)
        out = scale_epilogue(acc, tl.load(xs_ptr + rm, mask=mask_m, other=0.0), ws)
    else:
        total = w4a8_tile(
            x_ptr,
            w_e,
            ws_ptr + e.to(tl.int64) * stride_se,
            rm,
            rn,
            mask_m,
            mask_n,
            K,
            group_size,
            num_groups,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            stride_sn,
            stride_sg,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_IS_STEP,
        )
        out = tl.load(xs_ptr + rm, mask=mask_m, other=0.0)[:, None] * total
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(OUT_DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def tile_schedule(
    group_offsets: torch.Tensor, m: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """group_offsets int [E+1] -> (offsets int32 [E+1], tile_expert int32 [T_max], tile_first int32 [E],
    T_max).

    tile_expert[t] is the expert owning M-tile t (E past the last tile), computed on the tensor's device
    without reading it back, so the launch never waits on the host."""
    offs = group_offsets.to(torch.int32).contiguous()
    e = offs.numel() - 1
    tiles = (offs[1:] - offs[:-1] + block_m - 1) // block_m  # [E] M-tiles per expert
    last = torch.cumsum(tiles, 0, dtype=torch.int32)  # [E] one past each expert's tiles
    first = (last - tiles).contiguous()
    # Every non-empty tile holds at least one row, and sum ceil(rows_e / B) <= ceil(M / B) + E.
    t_max = max(1, min(m, triton.cdiv(m, block_m) + e))
    probe = torch.arange(t_max, dtype=torch.int32, device=offs.device)
    tile_expert = torch.searchsorted(last, probe, right=True).to(torch.int32)
    return offs, tile_expert, first, t_max


def _config(variant: int, m: int, e: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if interpreter_active():
        # few, big programs (the interpreter's cost is per operation); NumPy's BLAS sums a tile's rows in
        # an order that depends on the tile, so float rows are not claimed batch-invariant there
        # (backends/cuda/_tiles.py)
        return 32, 256, 128, 4, 1
    if variant == FLOAT:
        # One fixed tile for float so a row's fp32 sum order never depends on the batch (batch invariance).
        return 64, 128, 64, 4, 4
    # Integer results are exact whatever the tile, so size BLOCK_M to the rows an expert gets.
    bm = max(16, min(128, triton.next_power_of_2(max(1, m // max(1, e)))))
    return bm, 128, 128, 4 if bm <= 64 else 8, 4


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows group_offsets[e]:group_offsets[e+1] of x times w[e]^T, for every expert, in one launch.

    float: x [M, K], w [E, N, K] same float dtype -> [M, N] out_dtype (default x.dtype);
    W8A8:  x int8 [M, K], x_scale f32 [M], w int8 [E, N, K], w_scale f32 [E, N];
    W4A8:  x int8 [M, K], x_scale f32 [M], w uint8 [E, N, K // 2], w_scale f32 [E, N, K // group_size].
    group_offsets: int32/int64 [E+1], 0 .. at most M, non-decreasing; the rows past the last offset
    (padding) get no tile and are zero (the output starts as one memset, never a host read).
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
    """
    m, k = x.shape
    e, n = w.shape[0], w.shape[1]
    variant = FLOAT if x.dtype.is_floating_point else (W8A8 if w.dtype == torch.int8 else W4A8)
    out_dtype = out_dtype or x.dtype
    out = torch.zeros((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = _config(variant, m, e)
    if variant == W4A8:
        bk = block_k_for(group_size, bk)
    offs, tile_expert, tile_first, t_max = tile_schedule(group_offsets, m, bm)
    xs = x_scale if x_scale is not None else offs
    ws = w_scale if w_scale is not None else offs
    ws_strides = (list(ws.stride()) + [0, 0, 0])[:3] if w_scale is not None else [0, 0, 0]
    grid = (t_max, triton.cdiv(n, bn))
    extra = {} if interpreter_active() else dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    _grouped_matmul_kernel[grid](
        x,
        xs,
        w,
        ws,
        out,
        offs,
        tile_expert,
        tile_first,
        n,
        k,
        e,
        group_size or 0,
        (k // group_size) if group_size else 0,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        *ws_strides,
        out.stride(0),
        VARIANT=variant,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        OUT_DTYPE=TL_DTYPES[out_dtype],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_IS_STEP=group_size == bk,
        **extra,
    )
    count_launch("grouped_matmul")
    return out


@triton.jit
def _grouped_dw_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    offs_ptr,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    PRECISION: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dw[e, n-tile, k-tile] = dy[rows of e, n-tile]^T @ x[rows of e, k-tile], fp32 accumulation in row
    order; the rows of e are read from offs on the device (an expert with no rows stores zeros)."""
    e = tl.program_id(0)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(2).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = rn < N
    mask_k = rk < K
    row_lo = tl.load(offs_ptr + e).to(tl.int64)
    row_hi = tl.load(offs_ptr + e + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_lo, row_hi, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < row_hi
        a = tl.load(
            dy_ptr + rn[:, None] * stride_dyn + rm[None, :] * stride_dym,
            mask=mask_n[:, None] & mask_m[None, :],
            other=0.0,
        )
        b = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = dw_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + rk[None, :]
    tl.store(out, acc.to(OUT_DTYPE), mask=mask_n[:, None] & mask_k[None, :])


def grouped_matmul_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the float variant, two launches, no host read:
    dx = the forward kernel on dy with w's [E, K, N] transposed *view* (dx[rows of e] = dy @ w[e]);
    dw = `_grouped_dw_kernel` (dw[e] = dy[rows of e]^T @ x[rows of e], zero for an empty expert).
    dy is taken in x's dtype (an fp32 out_dtype's gradient is rounded once, as the operands are)."""
    dy = dy.to(x.dtype)
    dx = grouped_matmul(dy, w.transpose(1, 2), group_offsets)
    e, n, k = w.shape
    dw = torch.empty((e, n, k), dtype=w.dtype, device=w.device)
    if e == 0 or n == 0 or k == 0:
        return dx, dw.zero_()
    offs = group_offsets.to(torch.int32).contiguous()
    bm, bn, bk = 32, 64, 64
    extra = {} if interpreter_active() else dict(num_warps=4, num_stages=3, enable_fp_fusion=False)
    grid = (e, triton.cdiv(n, bn), triton.cdiv(k, bk))
    _grouped_dw_kernel[grid](
        dy,
        x,
        dw,
        offs,
        n,
        k,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        dw.stride(0),
        dw.stride(1),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        OUT_DTYPE=TL_DTYPES[w.dtype],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **extra,
    )
    count_launch("grouped_matmul_dw")
    return dx, dw
