"""Per-row symmetric dynamic int8 quantization (SPEC 2.5).

One program owns BLOCK_M rows and streams them twice in BLOCK_K column tiles: pass 1 takes the row
amax, pass 2 quantizes. Numerics are bitwise those of the reference: the input is widened to fp32
(exact), amax is a max (order-free), `scale = max(amax, 1e-10) / 127` and `x / scale` use
correctly rounded division (`div_rn`; Triton's plain `/` on fp32 is an approximate divide on
NVIDIA), and rounding is half-to-even by the fp32 magic-number trick `(v + 1.5*2**23) - 1.5*2**23`,
exact for |v| < 2**22 (here |v| <= 127 * (1 + 2**-23)). NaN is explicit (a NaN row's scale is NaN, a
NaN quotient is code 0), since the GPU's max and fmax drop NaN where the interpreter's NumPy keeps it.
libdevice `rint` would do on a GPU but the
interpreter has no binding for it, so one code path serves both and CI tests the one the GPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active

# 1.5 * 2**23: adding it pushes the fraction bits out of an fp32 mantissa with round-to-nearest-even.
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _dynamic_quant_int8_kernel(
    x_ptr,
    xq_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    rm64 = rm.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = mask_m[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xf), axis=1), propagate_nan=tl.PropagateNan.ALL)
        # max reductions and fmax drop NaN on the GPU: a NaN anywhere in the row makes its scale NaN
        nan_seen = tl.max(tl.where(xf != xf, 1.0, 0.0), axis=1)
        amax = tl.where(nan_seen > 0.0, float("nan"), amax)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10, propagate_nan=tl.PropagateNan.ALL), 127.0)  # [BLOCK_M]
    tl.store(scale_ptr + rm, scale, mask=mask_m)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = mask_m[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mask, other=0.0)
        q = tl.math.div_rn(x.to(tl.float32), scale[:, None])
        q = (q + _RNE_MAGIC) - _RNE_MAGIC  # round half to even
        q = tl.where(q != q, 0.0, tl.minimum(tl.maximum(q, -127.0), 127.0))  # a NaN quotient is code 0
        tl.store(xq_ptr + rm64[:, None] * stride_qm + kk[None, :], q.to(tl.int8), mask=mask)


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float32/float16/bfloat16 -> (x_q int8 [M, K], scale float32 [M]).

    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
    """
    m, k = x.shape
    x_q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scale
    # GPU: tiles near 4K elements (decode-sized M still gets a program per row); interpreter: few, big
    # programs, since its cost is per operation, not per element.
    big = interpreter_active()
    block_k = min(triton.next_power_of_2(k), 2048 if big else 1024)
    block_m = max(1, min((32768 if big else 4096) // block_k, triton.next_power_of_2(m), 64 if big else 16))
    grid = (triton.cdiv(m, block_m),)
    _dynamic_quant_int8_kernel[grid](
        x, x_q, scale, m, k, x.stride(0), x.stride(1), x_q.stride(0), BLOCK_M=block_m, BLOCK_K=block_k
    )
    count_launch("dynamic_quant_int8")
    return x_q, scale
