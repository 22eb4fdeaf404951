"""FP8 quantization kernels: per-token-group e4m3 (SPEC 7.1) and FlashMLA's 656-byte latent-cache rows
(SPEC 7.6), bitwise the reference on GPUs and under the interpreter.

`snap_e4m3` rounds an fp32 value to the e4m3 grid in fp32 arithmetic (saturate to +-448, RNE at the
value's e4m3 spacing, subnormal spacing 2**-9 below 2**-6) before the cast, so the cast only ever sees
representable values. That keeps one code path exact in both places: the GPU's cvt.rn.satfinite is RNE,
but Triton 3.5's interpreter converts by truncating bit fields (ties away from zero, wrong subnormals,
no saturation); for representable values both are exact. Scales come from exponent bits (`pow2_ceil`),
divisions are IEEE (`div_rn`). NaN inputs are outside the contract (PTX min/max drop NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch

E4M3_MAX = 448.0
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 to an integer, half to even


@triton.jit
def snap_e4m3(y):
    """fp32 -> the nearest e4m3 value (RNE, saturating), still as fp32."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), 448.0)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 127 - 6)  # below 2**-6 the grid is the subnormal spacing 2**-9
    inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - (e - 127))
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC) * ulp  # a * inv_ulp < 16: exact power-of-two scaling
    # the sign goes back on afterwards, so values that round to zero keep it (-0.0, as the cast gives)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def rne_bf16(x):
    """fp32 -> the nearest bf16 value, ties to even, still as fp32 (the interpreter's own fp32 -> bf16
    cast truncates; after this every cast is exact)."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil(s):
    """2 ** ceil(log2 s) for positive normal fp32 s: bump the exponent unless the mantissa is zero."""
    b = s.to(tl.int32, bitcast=True)
    return ((b + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _quant_group_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    G,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    eps,
    UE8M0: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + m * stride_xm + cols * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), eps)
    s = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        s = pow2_ceil(s)
    tl.store(s_ptr + m * stride_sm + g, s)
    y = snap_e4m3(tl.math.div_rn(x, s))
    tl.store(q_ptr + m * stride_qm + cols, y.to(tl.float8e4nv), mask=mask)


def fp8_quant_group(
    x: torch.Tensor, group_size: int, eps: float, ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (e4m3 [M, K], fp32 scales [M, ceil(K / group_size)]).
    Semantics: backends/reference/fp8_quant_group.py (SPEC 7.1)"""
    m, k = x.shape
    g = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m and k:
        _quant_group_kernel[(m, g)](
            x,
            q,
            s,
            k,
            g,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            s.stride(0),
            float(eps),
            UE8M0=ue8m0,
            GROUP=group_size,
            BLOCK=triton.next_power_of_2(group_size),
        )
        count_launch("fp8_quant_group")
    return q, s


@triton.jit
def _mla_rows_kernel(
    kv_ptr, lat_ptr, sc_ptr, rope_ptr, stride_kv, stride_row_lat, stride_row_sc, stride_row_rope, floor
):
    """One token: four 128-wide latent tiles with power-of-two scales, then the 64 RoPE values."""
    n = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    cols = t * 128 + tl.arange(0, 128)
    x = tl.load(kv_ptr + n * stride_kv + cols).to(tl.float32)
    s = pow2_ceil(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), floor))
    tl.store(sc_ptr + n * stride_row_sc + t, s)
    tl.store(lat_ptr + n * stride_row_lat + cols, snap_e4m3(tl.math.div_rn(x, s)).to(tl.float8e4nv))
    if t == 0:
        r = tl.arange(0, 64)
        rope = rne_bf16(tl.load(kv_ptr + n * stride_kv + 512 + r).to(tl.float32))
        tl.store(rope_ptr + n * stride_row_rope + r, rope.to(tl.bfloat16))


def fp8_mla_cache_quant(kv: torch.Tensor) -> torch.Tensor:
    """kv [N, 576] float -> uint8 [N, 656] rows (512 e4m3 | 4 fp32 scales | 64 bf16).
    Semantics: backends/reference/fp8_mla_cache_quant.py (SPEC 7.6)"""
    n = kv.shape[0]
    rows = torch.empty((n, 656), dtype=torch.uint8, device=kv.device)
    if n:
        if kv.stride(1) != 1:
            kv = kv.contiguous()
        lat = rows[:, :512].view(torch.float8_e4m3fn)
        sc = rows[:, 512:528].view(torch.float32)
        rope = rows[:, 528:].view(torch.bfloat16)
        _mla_rows_kernel[(n, 4)](
            kv, lat, sc, rope, kv.stride(0), lat.stride(0), sc.stride(0), rope.stride(0), 1e-4
        )
        count_launch("fp8_mla_cache_quant")
    return rows
