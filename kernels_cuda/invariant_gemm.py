"""The exact integer product of the layout-invariant mode from int8 digit slices (SPEC 12).

Input: the grid values of A and B as S signed int8 digits of `slice_bits` bits each, most significant
first (a = sum_i d_i 2^(slice_bits (S - 1 - i))): A's digits [S, Bt, M, K], B's stacked on N and
transposed [Bt, S N, K] (digit j of column n is row j N + n; backends/invariant/gemm.b_form's int8 form).
Output: P = A B exactly, int64 [Bt, M, N].

One program computes a BLOCK_M x BLOCK_N tile of one batch entry (programs in GROUP_M-row bands, so
neighbours share B's tiles in L2). For each level l = i + j of the 2S - 1 levels, most significant first,
it streams K in BLOCK_K steps through `tl.dot(int8, int8) -> int32` of every digit pair (i, j) of that
level into one int32 accumulator S_l (IMMA / wgmma s8 on NVIDIA, NumPy's integer matmul under the
interpreter), then folds it into the int64 tile: P = (P << slice_bits) + S_l. Every product and sum is an
integer below its type's range (|S_l| <= S K 2^(2 (slice_bits - 1)) < 2^31, checked by the launcher;
|P| < 2^63 is the caller's grid bound), so the result does not depend on the tile shapes, the K order or
the hardware: it is the same integers as the other engines of backends/invariant/gemm.py, bitwise.
Levels outermost keep one int32 and one int64 accumulator live (7 int32 tiles would not fit the
registers of a useful tile); the cost is reloading each digit tile once per level it enters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active


@triton.jit
def _band_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`: GROUP_M row tiles per band, so neighbours share B's tiles."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % band) % rows_in_band, (pid % band) // rows_in_band


@triton.jit
def _digit_product_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_ad,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bn,
    stride_bk,
    stride_ob,
    stride_om,
    SLICES: tl.constexpr,
    SLICE_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _band_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    batch = tl.program_id(1).to(tl.int64)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_base = a_ptr + batch * stride_ab + rm[:, None] * stride_am
    b_base = b_ptr + batch * stride_bb
    stride_digit = tl.cast(stride_ad, tl.int64)  # 3 x a digit's stride may pass 2^31
    p = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int64)
    for level in tl.static_range(2 * SLICES - 1):
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask_k = kk < K
            for i in tl.static_range(SLICES):
                for j in tl.static_range(SLICES):
                    if i + j == level:
                        a = tl.load(
                            a_base + i * stride_digit + kk[None, :] * stride_ak,
                            mask=mask_m[:, None] & mask_k[None, :],
                            other=0,
                        )
                        b = tl.load(
                            b_base + (rn + j * N)[None, :] * stride_bn + kk[:, None] * stride_bk,
                            mask=mask_k[:, None] & mask_n[None, :],
                            other=0,
                        )
                        s = tl.dot(a, b, s, out_dtype=tl.int32)
        p = (p << SLICE_BITS) + s.to(tl.int64)
    tl.store(
        out_ptr + batch * stride_ob + rm[:, None] * stride_om + rn[None, :],
        p,
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _interpreter_tile(m: int, n: int, k: int) -> tuple[int, int, int]:
    def clamp(v: int, lo: int, hi: int) -> int:
        return max(lo, min(hi, triton.next_power_of_2(v)))

    # K >= 32: the int8 MMA depth the GPU needs, kept here so both run the same shapes
    return clamp(m, 16, 64), clamp(n, 16, 128), clamp(k, 32, 256)


def _gpu_tile(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): a decode-sized M gets a short tile."""
    if m <= 16:
        return 16, 64, 128, 4, 3
    if m <= 64:
        return 64, 64, 128, 4, 3
    return 128, 128, 64, 8, 3


def digit_product(a_digits: torch.Tensor, b_digits: torch.Tensor, slice_bits: int) -> torch.Tensor:
    """a_digits: int8 [S, Bt, M, K], b_digits: int8 [Bt, S N, K] (B's digits stacked on N, transposed),
    every digit |d| <= 2^(slice_bits - 1) -> int64 [Bt, M, N]: sum over the digit pairs (i, j) of
    (A_i B_j) 2^(slice_bits (2 S - 2 - i - j)), exactly (the caller keeps |P| < 2^63).

    Semantics: backends/invariant/gemm.int_product (SPEC 12, "int8 digits")
    """
    if a_digits.dtype != torch.int8 or b_digits.dtype != torch.int8:
        raise ValueError(f"digits: expected int8, got {a_digits.dtype} and {b_digits.dtype}")
    if a_digits.dim() != 4 or b_digits.dim() != 3:
        raise ValueError(
            f"digits: expected a [S, Bt, M, K] and b [Bt, S N, K], got {tuple(a_digits.shape)} and "
            f"{tuple(b_digits.shape)}"
        )
    slices, batch, m, k = a_digits.shape
    if b_digits.shape[0] != batch or b_digits.shape[2] != k or b_digits.shape[1] % slices:
        raise ValueError(
            f"digits: b {tuple(b_digits.shape)} does not match a {tuple(a_digits.shape)} "
            "(expected [Bt, S N, K])"
        )
    if slices * k << (2 * (slice_bits - 1)) >= 1 << 31:
        raise ValueError(
            f"K: {k} x {slices} digit pairs of {slice_bits} bits could overflow the int32 accumulator"
        )
    n = b_digits.shape[1] // slices
    out = torch.empty((batch, m, n), dtype=torch.int64, device=a_digits.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    args = (
        a_digits,
        b_digits,
        out,
        m,
        n,
        k,
        *a_digits.stride(),
        *b_digits.stride(),
        out.stride(0),
        out.stride(1),
    )
    flags = dict(SLICES=slices, SLICE_BITS=slice_bits, GROUP_M=8)
    if interpreter_active():  # few, big programs: the interpreter's cost is per operation
        bm, bn, bk = _interpreter_tile(m, n, k)
        extra = {}
    else:
        bm, bn, bk, warps, stages = _gpu_tile(m)
        extra = dict(num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), batch)
    _digit_product_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra)
    count_launch("invariant_gemm")
    return out
