"""FP8 helpers of the cpu backend (SPEC 7): a fast e4m3 decode and the exact per-block GEMM core shared by
fp8_block_matmul and fp8_grouped_matmul.

torch's e4m3 -> float cast is a scalar loop (~6 ns an element); `decode` re-biases the bits through
bfloat16 instead (vectorised shifts, one exact multiply by 2**120), bit for bit the cast, NaN included.
Operands are decoded in 128-column slices that stay in cache: a fresh 100 MB fp64 copy of a weight
costs more in page faults and memory traffic than the GEMM that reads it.
"""

from __future__ import annotations

import torch

from backends.cpu._workspace import buffer
from backends.formats import BLOCK, cdiv

_REBIAS = 2.0**120  # bf16 bias 127 vs e4m3 bias 7; exact for normals and subnormals alike
_MASK = -30721  # 0x87FF as int16: keep the sign and the 7 shifted exponent+mantissa bits
_MAGNITUDE, _NAN_BITS = 0x7F0, 0x7F0  # e4m3 NaN: exponent and mantissa all ones
_LOW7, _ONES, _HIGH = 0x7F7F7F7F7F7F7F7F, 0x0101010101010101, -0x7F7F7F7F7F7F7F80  # 0x8080..80
#: elements of one K block's [rows, N] fp64 dot products (4 MiB), which bounds the rows per GEMM
ROW_ELEMS = 1 << 19


def has_nan_code(codes: torch.Tensor) -> bool:
    """Whether any byte of an e4m3 tensor is a NaN code (x & 0x7f == 0x7f), eight bytes per int64 lane:
    t = (w & 0x7f..) ^ 0x7f.. has a zero byte exactly there, found by (t - 0x01..) & ~t & 0x80.."""
    u = codes.view(torch.uint8).contiguous().reshape(-1)  # a copy only for a strided view
    if u.numel() % 8 or u.numel() == 0 or u.storage_offset() % 8:
        return bool(((u & 0x7F) == 0x7F).any())
    t = u.view(torch.int64).bitwise_and(_LOW7).bitwise_xor_(_LOW7)
    return bool((t - _ONES).bitwise_and_(t.bitwise_not_()).bitwise_and_(_HIGH).any())


def decode(
    codes: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    nan: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """e4m3 (or its uint8 bytes) [...] -> `dtype` (into `out` if given, same shape), equal to
    `codes.to(dtype)` bit for bit; NaN codes (which the re-biased bits would read as +-480) come out NaN.
    nan: whether the caller knows there are NaN codes (False skips the check); None checks."""
    u = (codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes).contiguous()
    bits = u.view(torch.int8).to(torch.int16).bitwise_left_shift_(4).bitwise_and_(_MASK)
    if out is None:
        out = bits.view(torch.bfloat16).to(dtype)
    else:
        out.copy_(bits.view(torch.bfloat16))
    out.mul_(_REBIAS)
    if nan if nan is not None else has_nan_code(u):
        out.masked_fill_(bits.bitwise_and(_MAGNITUDE) == _NAN_BITS, float("nan"))
    return out


def block_matmul_into(
    acc: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor
) -> None:
    """acc fp32 [M, N] (zeroed) += the promoted block sum of SPEC 7.2, exactly the reference's:
    d[kb] = fp32(exact fp64 block dot), term = (d * x_scale[m, kb]) * w_scale_inv[n // 128, kb], added to
    acc for kb ascending. Per K block one fp64 GEMM over every column (per slice of rows); the operands'
    128-column slices are decoded as they are needed, so nothing larger than a slice is ever fp64."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if m == 0 or n == 0 or k == 0:
        return
    xs = x_scale.float()
    ws = w_scale_inv.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, KB]: each column's block scales
    rows = max(1, ROW_ELEMS // n)
    x8, w8 = x_q.view(torch.uint8), w_q.view(torch.uint8)
    x_nan, w_nan = has_nan_code(x8), has_nan_code(w8)  # once, not per slice
    for kb in range(cdiv(k, BLOCK)):
        c = slice(kb * BLOCK, min((kb + 1) * BLOCK, k))
        w64 = decode(w8[:, c], torch.float64, w_nan)  # [N, <=128]
        ws_kb = ws[:, kb].contiguous()
        for r0 in range(0, m, rows):
            r1 = min(r0 + rows, m)
            x64 = decode(x8[r0:r1, c], torch.float64, x_nan)
            d64 = buffer("fp8.d64", (r1 - r0) * n, torch.float64).view(r1 - r0, n)
            torch.mm(x64, w64.T, out=d64)  # exact block sums
            d = buffer("fp8.d32", (r1 - r0) * n).view(r1 - r0, n)
            d.copy_(d64)  # rounded once to fp32, as the reference
            d.mul_(xs[r0:r1, kb, None]).mul_(ws_kb[None, :])
            acc[r0:r1].add_(d)
