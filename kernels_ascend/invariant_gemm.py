"""The level sums of the layout-invariant mode's exact product from int8 digits (SPEC 12, "int8 digits").

Input: the grid values of A and B as S signed int8 digits of `slice_bits` bits each, most significant
first (a = sum_i d_i 2^(slice_bits (S - 1 - i))): A's digits [S, Bt, M, K], B's [Bt, S, N, K]
(backends/invariant/gemm.b_form's "ascend" form); either may be a strided view (a broadcast batch is
stride 0). Output: the 2S - 1 level sums S_l = sum_{i + j = l} A_i B_j^T, int32 [Bt, 2S - 1, M, N]; the
caller combines them into P = sum_l S_l 2^(slice_bits (2S - 2 - l)) in int64.

One program per AI core (the cube unit: `tl.dot`) loops over BLOCK_M x BLOCK_N output tiles of every
batch entry. For each level, most significant first, it streams K in BLOCK_K steps through
`tl.dot(int8, int8) -> int32` of every digit pair (i, j) of that level into one int32 accumulator and
stores it. Every product and sum is an integer below 2^31 (|S_l| <= S K 2^(2 (slice_bits - 1)), checked
by the launcher: K < 131,072 for four 7-bit digits), so the sums do not depend on the tiles, the K order
or the hardware. Nothing here is int64 or a float: the cube has no fp64 and the vector unit runs int64
as scalar code; only the batch and digit offsets (scalars) are widened to int64. Levels outermost keep
one accumulator live; the cost is reloading each digit tile once per level it enters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, interpreter_active, num_cores

# the device's tiles: A 64 x 128 and B 64 x 128 int8, the int32 accumulator 64 x 64: 32 KB of the UB
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 128


@triton.jit
def _level_sums_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    BATCH,
    M,
    N,
    K,
    stride_ad,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bd,
    stride_bn,
    stride_bk,
    tiles_per_prog,
    SLICES: tl.constexpr,
    NPROG: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_batch = tiles_m * tiles_n
    for it in range(0, tiles_per_prog):
        tile = pid + it * NPROG
        if tile < BATCH * per_batch:
            batch = tile // per_batch
            om = ((tile % per_batch) // tiles_n) * BM + tl.arange(0, BM)
            on = (tile % tiles_n) * BN + tl.arange(0, BN)
            mm = om < M
            mn = on < N
            a_tile = a_ptr + batch.to(tl.int64) * stride_ab + om[:, None] * stride_am
            b_tile = b_ptr + batch.to(tl.int64) * stride_bb + on[:, None] * stride_bn
            o_tile = out_ptr + batch.to(tl.int64) * (2 * SLICES - 1) * M * N + om[:, None] * N + on[None, :]
            for level in tl.static_range(2 * SLICES - 1):
                acc = tl.zeros([BM, BN], dtype=tl.int32)
                for k0 in range(0, K, BK):
                    ok = k0 + tl.arange(0, BK)
                    mk = ok < K
                    a_ptrs = a_tile + ok[None, :] * stride_ak
                    b_ptrs = b_tile + ok[None, :] * stride_bk
                    a_mask = mm[:, None] & mk[None, :]
                    b_mask = mn[:, None] & mk[None, :]
                    for i in tl.static_range(SLICES):
                        for j in tl.static_range(SLICES):
                            if i + j == level:
                                a = tl.load(a_ptrs + tl.cast(stride_ad, tl.int64) * i, mask=a_mask, other=0)
                                b = tl.load(b_ptrs + tl.cast(stride_bd, tl.int64) * j, mask=b_mask, other=0)
                                acc += tl.dot(a, tl.trans(b))
                tl.store(o_tile + tl.cast(M, tl.int64) * N * level, acc, mask=mm[:, None] & mn[None, :])


def _interpreter_tile(m: int, n: int, k: int) -> tuple[int, int, int]:
    """Few, big tiles: the interpreter's cost is per operation, NumPy's integer matmul is exact at any K."""

    def clamp(v: int, lo: int, hi: int) -> int:
        return max(lo, min(hi, triton.next_power_of_2(v)))

    return clamp(m, 16, 64), clamp(n, 16, 128), clamp(k, 32, 1024)


def _span(d: torch.Tensor) -> int:
    """The largest element offset inside one digit plane [R, K] (the tile's int32 vector offsets)."""
    return (d.shape[-2] - 1) * abs(d.stride(-2)) + (d.shape[-1] - 1) * abs(d.stride(-1))


def level_sums(a_digits: torch.Tensor, b_digits: torch.Tensor, slice_bits: int) -> torch.Tensor:
    """a_digits: int8 [S, Bt, M, K], b_digits: int8 [Bt, S, N, K], every digit |d| <= 2^(slice_bits - 1)
    -> int32 [Bt, 2S - 1, M, N]: S_l = sum_{i + j = l} A_i B_j^T, exactly.

    Semantics: backends/invariant/gemm.int_product (SPEC 12, "int8 digits")
    """
    if a_digits.dtype != torch.int8 or b_digits.dtype != torch.int8:
        raise ValueError(f"digits: expected int8, got {a_digits.dtype} and {b_digits.dtype}")
    if a_digits.dim() != 4 or b_digits.dim() != 4:
        raise ValueError(
            f"digits: expected a [S, Bt, M, K] and b [Bt, S, N, K], got {tuple(a_digits.shape)} and "
            f"{tuple(b_digits.shape)}"
        )
    slices, batch, m, k = a_digits.shape
    if b_digits.shape[0] != batch or b_digits.shape[1] != slices or b_digits.shape[3] != k:
        raise ValueError(
            f"digits: b {tuple(b_digits.shape)} does not match a {tuple(a_digits.shape)} "
            "(expected [Bt, S, N, K])"
        )
    if slices * k << (2 * (slice_bits - 1)) >= 1 << 31:
        raise ValueError(
            f"K: {k} x {slices} digit pairs of {slice_bits} bits could overflow the int32 accumulator"
        )
    n = b_digits.shape[2]
    if max(m * n, _span(a_digits), _span(b_digits)) >= 1 << 31:
        raise ValueError(f"digits: a plane of {m} x {n} x {k} passes the kernel's int32 tile offsets")
    levels = 2 * slices - 1
    out = torch.empty((batch, levels, m, n), dtype=torch.int32, device=a_digits.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    if interpreter_active():
        bm, bn, bk = _interpreter_tile(m, n, k)
    else:
        bm, bn, bk = BLOCK_M, BLOCK_N, BLOCK_K
    tiles = batch * triton.cdiv(m, bm) * triton.cdiv(n, bn)
    nprog = min(num_cores("aicore"), tiles)
    _level_sums_kernel[(nprog,)](
        a_digits,
        b_digits,
        out,
        batch,
        m,
        n,
        k,
        *a_digits.stride(),
        *b_digits.stride(),
        triton.cdiv(tiles, nprog),
        SLICES=slices,
        NPROG=nprog,
        BM=bm,
        BN=bn,
        BK=bk,
    )
    count_launch("invariant_gemm")
    return out
