"""Per-group W4A8 GEMM for Ascend (SPEC 2.7): the form the fused operators do not take (npu_grouped_matmul's
int4 path is per-channel, bf16/fp16 output, and folds the bias before the per-token scale).

One program per AI core loops over (BLOCK_M x BLOCK_N) output tiles. Weights stay in the canonical
layout, uint8 [N, K//2] with w[n, 2i] in the low nibble: instead of interleaving nibbles, the kernel
loads the even and the odd activation columns separately and does two int8 dots per K tile,
acc += x[:, 0::2] . lo^T + x[:, 1::2] . hi^T (exact int32). Each group's int32 sum is scaled in fp32
and added in group order, then x_scale and bias: the reference's rounding points, so bitwise equal.
Tiles: x 32 x 64 int8, w 64 x 32 bytes, acc 32 x 64 int32 (8 KB): inside the UB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_M, BLOCK_N = 32, 64


@triton.jit
def _w4a8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    GROUP_HALF,
    tiles_per_prog,
    HAS_BIAS: tl.constexpr,
    NPROG: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKH: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * tiles_n
    KH = K // 2
    for it in range(0, tiles_per_prog):
        tile = pid + it * NPROG
        if tile < n_tiles:
            om = (tile // tiles_n) * BM + tl.arange(0, BM)
            on = (tile % tiles_n) * BN + tl.arange(0, BN)
            mm = om < M
            mn = on < N
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for g in range(0, G):
                acc = tl.zeros([BM, BN], dtype=tl.int32)
                for h0 in range(0, GROUP_HALF, BKH):
                    oh = g * GROUP_HALF + h0 + tl.arange(0, BKH)  # byte columns of this group
                    mh = (h0 + tl.arange(0, BKH)) < GROUP_HALF
                    xe = tl.load(
                        x_ptr + om[:, None] * K + 2 * oh[None, :], mask=mm[:, None] & mh[None, :], other=0
                    )
                    xo = tl.load(
                        x_ptr + om[:, None] * K + 2 * oh[None, :] + 1, mask=mm[:, None] & mh[None, :], other=0
                    )
                    b = tl.load(
                        w_ptr + on[:, None] * KH + oh[None, :], mask=mn[:, None] & mh[None, :], other=0
                    ).to(tl.int32)
                    lo = b & 15
                    hi = b >> 4
                    lo = tl.where(lo >= 8, lo - 16, lo).to(tl.int8)
                    hi = tl.where(hi >= 8, hi - 16, hi).to(tl.int8)
                    acc += tl.dot(xe, tl.trans(lo))
                    acc += tl.dot(xo, tl.trans(hi))
                ws = tl.load(ws_ptr + on * G + g, mask=mn, other=0.0)
                total = total + acc.to(tl.float32) * ws[None, :]
            xs = tl.load(xs_ptr + om, mask=mm, other=0.0)
            out = xs[:, None] * total
            if HAS_BIAS:
                out = out + tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + om[:, None] * N + on[None, :], out, mask=mm[:, None] & mn[None, :])


def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K]; x_scale: fp32 [M]; w_packed: uint8 [N, K//2]; w_scale: fp32 [N, K // group_size];
    group_size even. Returns [M, N] out_dtype.
    Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)"""
    m, k = x_q.shape
    n = w_packed.shape[0]
    if group_size % 2:
        raise ValueError(
            f"group_size: expected an even value (a byte must not straddle two groups), got {group_size}"
        )
    # fp32 tile results; the cast to out_dtype is torch's round-to-nearest-even (the interpreter's
    # in-kernel fp32 -> bf16 cast truncates, which would differ from the reference by an ulp)
    out = torch.empty((m, n), dtype=torch.float32, device=x_q.device)
    if m == 0 or n == 0:
        return out.to(out_dtype)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    nprog = min(num_cores("aicore"), tiles)
    half = group_size // 2
    bkh = max(16, min(32, triton.next_power_of_2(half)))  # tl.dot needs every dim >= 16
    _w4a8_kernel[(nprog,)](
        x_q.contiguous(),
        x_scale.contiguous(),
        w_packed.contiguous(),
        w_scale.contiguous(),
        bias if bias is not None else x_scale,
        out,
        m,
        n,
        k,
        k // group_size,
        half,
        triton.cdiv(tiles, nprog),
        HAS_BIAS=bias is not None,
        NPROG=nprog,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BKH=bkh,
    )
    count_launch("w4a8_matmul")
    return out.to(out_dtype)
