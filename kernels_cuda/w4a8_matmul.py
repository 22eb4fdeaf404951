"""W4A8 GEMM: int8 activations x packed signed int4 weights, per-group or per-channel scales (SPEC 2.7).

One program computes a BLOCK_M x BLOCK_N tile of `out`. For each scale group g (in order 0, 1, ...)
it streams the group's K range in BLOCK_K steps: the weight tile is loaded as packed bytes (column k
reads byte k // 2; neighbouring k share a byte, so the second read hits L1), unpacked in registers
(low nibble for even k, high nibble for odd k, sign-extended from 4 bits: SPEC 2.7 order) and fed to
`tl.dot(int8, int8) -> int32`, so the group accumulator acc_g is exact. The group's contribution is
then added in fp32, `total += float32(acc_g) * w_scale[n, g]`, in group order, and the epilogue is
`x_scale[m] * total (+ bias[n])`, then one RNE cast: the reference's operations in the reference's
order (launched with `enable_fp_fusion=False`, so no FMA contraction), hence bitwise equal.
The (group, step) pairs run as one flat loop, so the compiler can pipeline loads across groups.
A group need not be a multiple of BLOCK_K: the last step of a group is masked at the group's end
(per-channel, group_size == K, is one group). `w4a8_tile` is shared with kernels_cuda.grouped_matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.w8a8_matmul import TL_DTYPES, grouped_tile, interpreter_tile


@triton.jit
def w4a8_tile(
    x_ptr,
    w_ptr,
    ws_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_IS_STEP: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = sum_g float32(x[rm, g] @ w[rn, g]^T) * w_scale[rn, g], g in order.
    w_ptr: packed uint8 [N, K // 2] with strides (stride_wn, stride_wk); rm, rn: int64 indices.
    GROUP_IS_STEP (group_size == BLOCK_K): each step is a whole group and is scaled at once."""
    rk = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(group_size, BLOCK_K)  # K steps per group
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    # one flat loop over (group, step) so the compiler can software-pipeline across groups
    for t in range(0, num_groups * steps):
        g = t // steps
        k_hi = (g + 1) * group_size
        kk = g * group_size + (t % steps) * BLOCK_K + rk
        mask_k = kk < k_hi  # a step never crosses its group
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )
        packed = tl.load(
            w_ptr + rn[None, :] * stride_wn + (kk // 2)[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        # column k is nibble k % 2 of byte k // 2; sign-extend from 4 bits
        nib = (packed.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 0xF
        w = (nib - ((nib & 8) << 1)).to(tl.int8)
        if GROUP_IS_STEP:
            ws = tl.load(ws_ptr + rn * stride_sn + g * stride_sg, mask=mask_n, other=0.0)
            total = total + tl.dot(a, w, out_dtype=tl.int32).to(tl.float32) * ws[None, :]
        else:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            if t % steps == steps - 1:  # group g complete
                ws = tl.load(ws_ptr + rn * stride_sn + g * stride_sg, mask=mask_n, other=0.0)
                total = total + acc.to(tl.float32) * ws[None, :]
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    return total


@triton.jit
def _w4a8_matmul_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    M_BUCKET,
    group_size,
    num_groups,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_om,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GROUP_IS_STEP: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    total = w4a8_tile(
        x_ptr,
        w_ptr,
        ws_ptr,
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
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(OUT_DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def block_k_for(group_size: int, cap: int = 128) -> int:
    """The K step: the largest power of two <= cap dividing group_size (so steps tile groups exactly),
    at least 32 (the int8 MMA depth); odd group sizes run with masked last steps."""
    bk = cap
    while bk > 32 and group_size % bk:
        bk //= 2
    return bk


def _gpu_configs() -> list[triton.Config]:
    out = []
    for bm, bn, stages, warps in (
        (128, 128, 4, 8),
        (128, 256, 3, 8),
        (64, 128, 4, 4),
        (64, 256, 3, 8),
        (32, 128, 4, 4),
        (16, 128, 4, 4),
        (16, 64, 4, 4),
    ):
        out.append(
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_stages=stages, num_warps=warps)
        )
    return out


_w4a8_matmul_tuned = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K", "group_size"])(
    _w4a8_matmul_kernel
)


def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K], x_scale: float32 [M], w_packed: uint8 [N, K // 2] (w[n, 2i] in the low nibble),
    w_scale: float32 [N, K // group_size], bias: [N] or None -> [M, N] out_dtype.

    Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
    """
    m, k = x_q.shape
    n = w_packed.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    num_groups = k // group_size
    args = (
        x_q,
        x_scale,
        w_packed,
        w_scale,
        bias if bias is not None else x_scale,
        out,
        m,
        n,
        k,
        min(triton.next_power_of_2(m), 4096),
        group_size,
        num_groups,
        x_q.stride(0),
        x_q.stride(1),
        w_packed.stride(0),
        w_packed.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
    )
    flags = dict(HAS_BIAS=bias is not None, OUT_DTYPE=TL_DTYPES[out_dtype])
    if interpreter_active():
        bm, bn, _ = interpreter_tile(m, n, k)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        bk = block_k_for(group_size, 256)
        _w4a8_matmul_kernel[grid](
            *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, GROUP_IS_STEP=group_size == bk
        )
    else:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        bk = block_k_for(group_size)
        _w4a8_matmul_tuned[grid](
            *args, **flags, BLOCK_K=bk, GROUP_IS_STEP=group_size == bk, enable_fp_fusion=False
        )
    count_launch("w4a8_matmul")
    return out
