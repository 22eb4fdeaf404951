"""W8A8 GEMM for Ascend (SPEC 2.6) for what npu_quant_matmul's A2/A3 table leaves out (fp32 output, fp16
output with a float bias, K > 65535).

One program per AI core loops over (BLOCK_M x BLOCK_N) output tiles; int8 x int8 tl.dot into an int32
accumulator over BLOCK_K tiles (exact), then the reference's fp32 epilogue in the reference's order:
acc * x_scale[m] * w_scale[n] + bias[n]. The fp32 tile goes back to torch for the final cast
(round-to-nearest-even), so results are bitwise the reference's.
Tiles: x 32 x 64, w 64 x 64 int8, acc 32 x 64 int32: 12 KB, inside the UB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@triton.jit
def _w8a8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_wn,
    stride_wk,
    tiles_per_prog,
    HAS_BIAS: tl.constexpr,
    NPROG: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * tiles_n
    for it in range(0, tiles_per_prog):
        tile = pid + it * NPROG
        if tile < n_tiles:
            om = (tile // tiles_n) * BM + tl.arange(0, BM)
            on = (tile % tiles_n) * BN + tl.arange(0, BN)
            mm = om < M
            mn = on < N
            acc = tl.zeros([BM, BN], dtype=tl.int32)
            for k0 in range(0, K, BK):
                ok = k0 + tl.arange(0, BK)
                mk = ok < K
                x = tl.load(x_ptr + om[:, None] * K + ok[None, :], mask=mm[:, None] & mk[None, :], other=0)
                w_off = on[:, None] * stride_wn + ok[None, :] * stride_wk
                w = tl.load(w_ptr + w_off, mask=mn[:, None] & mk[None, :], other=0)
                acc += tl.dot(x, tl.trans(w))
            xs = tl.load(xs_ptr + om, mask=mm, other=0.0)
            ws = tl.load(ws_ptr + on, mask=mn, other=0.0)
            out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
            if HAS_BIAS:
                out = out + tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + om[:, None] * N + on[None, :], out, mask=mm[:, None] & mn[None, :])


def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K]; x_scale: fp32 [M]; w_q: int8 [N, K] (any strides); w_scale: fp32 [N];
    bias: [N] or None.
    Returns [M, N] out_dtype.
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)"""
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.zeros((m, n), dtype=torch.float32, device=x_q.device)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    if tiles:
        nprog = min(num_cores("aicore"), tiles)
        _w8a8_kernel[(nprog,)](
            x_q.contiguous(),
            x_scale.contiguous(),
            w_q,  # strided: a prepared (K-major) weight is read in place
            w_scale.contiguous(),
            bias.contiguous() if bias is not None else x_scale,
            out,
            m,
            n,
            k,
            w_q.stride(0),
            w_q.stride(1),
            triton.cdiv(tiles, nprog),
            HAS_BIAS=bias is not None,
            NPROG=nprog,
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
        )
        count_launch("w8a8_matmul")
    return out.to(out_dtype)
