"""W8A8 GEMM: int8 x int8 -> exact int32, then the per-token x per-channel scale epilogue (SPEC 2.6).

One program computes a BLOCK_M x BLOCK_N tile of `out`, streaming K in BLOCK_K steps through
`tl.dot(int8, int8) -> int32` (IMMA / wgmma s8 on NVIDIA, NumPy int32 under the interpreter), so the
accumulator is exact for any K the int32 range allows (|acc| <= 128 * 128 * K < 2**31 for K < 131072;
backends/cuda/w8a8_matmul.py declines larger K).
Programs are ordered in GROUP_M-row bands so consecutive programs reuse weight tiles in L2.
The epilogue is the reference's, operation by operation: `float32(acc) * x_scale[m] * w_scale[n] + bias[n]`,
then one round-to-nearest-even cast to out_dtype. Kernels are launched with `enable_fp_fusion=False`
so the multiply and the bias add are not contracted into an FMA (which would round once where the
reference rounds twice): the result is bitwise the reference's.
`int8_tile` and `scale_epilogue` are shared with kernels_cuda.grouped_matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def int8_tile(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """int32 [BLOCK_M, BLOCK_N] = x[rm, :K] @ w[rn, :K]^T, exact. rm, rn: int64 row / column indices."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`: GROUP_M row tiles per band, so neighbours share weight tiles."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % band) % rows_in_band, (pid % band) // rows_in_band


@triton.jit
def scale_epilogue(acc, x_scale, w_scale):
    """fp32 [BLOCK_M, BLOCK_N] = float32(acc) * x_scale[:, None] * w_scale[None, :], in that order."""
    return (acc.to(tl.float32) * x_scale[:, None]) * w_scale[None, :]


@triton.jit
def _w8a8_matmul_kernel(
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
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    acc = int8_tile(
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
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    xs = tl.load(xs_ptr + rm, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=mask_n, other=0.0)
    out = scale_epilogue(acc, xs, ws)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(OUT_DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _gpu_configs() -> list[triton.Config]:
    # Hopper int8 tiles (DeepGEMM / vLLM triton_scaled_mm territory): wide N, K=128, deep pipelines;
    # plus small-M shapes for decode.
    out = []
    for bm, bn, bk, stages, warps in (
        (128, 256, 128, 3, 8),
        (128, 128, 128, 4, 8),
        (256, 128, 128, 3, 8),
        (64, 128, 128, 4, 4),
        (64, 256, 128, 3, 8),
        (32, 128, 128, 4, 4),
        (16, 128, 256, 3, 4),
        (16, 64, 256, 4, 4),
    ):
        out.append(
            triton.Config(
                {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                num_stages=stages,
                num_warps=warps,
            )
        )
    return out


# Autotuned on GPUs, keyed by an M bucket and (N, K); the interpreter runs the plain kernel with small tiles.
_w8a8_matmul_tuned = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K"])(_w8a8_matmul_kernel)


def interpreter_tile(m: int, n: int, k: int) -> tuple[int, int, int]:
    def clamp(v: int, lo: int, hi: int) -> int:
        return max(lo, min(hi, triton.next_power_of_2(v)))

    # K >= 32: the int8 MMA depth the GPU needs, kept here so both run the same shapes
    return clamp(m, 16, 64), clamp(n, 16, 256), clamp(k, 32, 256)


def _launch(x_q, x_scale, w_q, w_scale, bias, out):
    m, k = x_q.shape
    n = w_q.shape[0]
    args = (
        x_q,
        x_scale,
        w_q,
        w_scale,
        bias if bias is not None else x_scale,
        out,
        m,
        n,
        k,
        min(triton.next_power_of_2(m), 4096),
        x_q.stride(0),
        x_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        out.stride(0),
    )
    flags = dict(HAS_BIAS=bias is not None, OUT_DTYPE=TL_DTYPES[out.dtype])
    if interpreter_active():
        # few, big programs: the interpreter's cost is per operation, not per element
        bm, bn, bk = interpreter_tile(m, n, k)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _w8a8_matmul_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
    else:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _w8a8_matmul_tuned[grid](*args, **flags, enable_fp_fusion=False)
    count_launch("w8a8_matmul")


def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q: int8 [M, K], x_scale: float32 [M], w_q: int8 [N, K], w_scale: float32 [N], bias: [N] or None
    -> [M, N] out_dtype.

    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
    """
    m, n = x_q.shape[0], w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    _launch(x_q, x_scale, w_q, w_scale, bias, out)
    return out
