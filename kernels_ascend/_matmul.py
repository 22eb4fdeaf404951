"""A strided fp32-accumulating tile matmul for Ascend, shared by the ops that need a plain GEMM
(linear_cross_entropy's chunks, float grouped_matmul outside the fused operator's dtypes).

C (+)= A @ B with arbitrary strides on A and B (so transposes are views, never copies). One program per
AI core loops over (BLOCK_M x BLOCK_N) output tiles, each a K loop of BLOCK_K tl.dot steps with operands
widened to fp32 (the interpreter's bf16 dot is wrong). Tiles: 32 x 64 fp32 (8 KB each), inside the UB.
Numerics: fp32 accumulation in K-tile order; fp32 tolerance against the reference, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    tiles_per_prog,
    ACCUMULATE: tl.constexpr,
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
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                ok = k0 + tl.arange(0, BK)
                mk = ok < K
                a = tl.load(
                    a_ptr + om[:, None] * sam + ok[None, :] * sak, mask=mm[:, None] & mk[None, :], other=0.0
                ).to(tl.float32)
                b = tl.load(
                    b_ptr + ok[:, None] * sbk + on[None, :] * sbn, mask=mk[:, None] & mn[None, :], other=0.0
                ).to(tl.float32)
                acc += tl.dot(a, b)
            cp = c_ptr + om[:, None] * N + on[None, :]
            cm = mm[:, None] & mn[None, :]
            if ACCUMULATE:
                acc += tl.load(cp, mask=cm, other=0.0)
            tl.store(cp, acc, mask=cm)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """out [M, N] fp32 contiguous (+)= a [M, K] @ b [K, N]; a and b may be strided views (transposes)."""
    m, k = a.shape
    n = b.shape[1]
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    if tiles == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    nprog = min(num_cores("aicore"), tiles)
    _mm_kernel[(nprog,)](
        a,
        b,
        out,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        triton.cdiv(tiles, nprog),
        ACCUMULATE=accumulate,
        NPROG=nprog,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    count_launch("matmul")
    return out
