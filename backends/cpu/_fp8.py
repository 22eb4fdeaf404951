"""FP8 helpers of the cpu backend (SPEC 7): a fast e4m3 decode and the exact per-block GEMM core shared by
fp8_block_matmul and fp8_grouped_matmul.

torch's e4m3 -> float cast is a scalar loop (~6 ns an element); `decode` re-biases the bits through
bfloat16 instead (vectorised shifts, one exact multiply by 2**120), bit for bit the cast, NaN included.
Large operands are decoded in slices that stay in cache: a fresh 100 MB fp64 copy of a weight costs
more in page faults and memory traffic than the GEMM that reads it.
"""

from __future__ import annotations

import torch

from backends.cpu._workspace import buffer
from backends.formats import BLOCK, cdiv

_REBIAS = 2.0**120  # bf16 bias 127 vs e4m3 bias 7; exact for normals and subnormals alike
_NAN_READS = 480.0
_MASK = -30721  # 0x87FF as int16: keep the sign and the 7 shifted exponent+mantissa bits
#: rows of x decoded to fp64 at a time (bounds the [KB, rows, 128] fp64 copy)
ROW_CHUNK = 256


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 (or its uint8 bytes) [...] -> `dtype`, equal to `codes.to(dtype)` bit for bit; NaN codes
    (0x7f / 0xff) come out NaN (the re-biased bits read +-480, which no e4m3 value is)."""
    u = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    bits = u.view(torch.int8).to(torch.int16).bitwise_left_shift_(4).bitwise_and_(_MASK)
    out = bits.view(torch.bfloat16).to(dtype).mul_(_REBIAS)
    return out.masked_fill_(out.abs() == _NAN_READS, float("nan"))


def _blocks64(q: torch.Tensor, kb: int) -> torch.Tensor:
    """e4m3 [R, K] -> fp64 [R, KB, 128], K zero-padded to whole blocks (zeros add nothing to an exact sum)."""
    r, k = q.shape
    if k == kb * BLOCK:
        return decode(q.contiguous(), torch.float64).view(r, kb, BLOCK)
    out = torch.zeros(r, kb * BLOCK, dtype=torch.float64)
    out[:, :k] = decode(q.contiguous(), torch.float64)
    return out.view(r, kb, BLOCK)


def block_matmul_into(
    acc: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor
) -> None:
    """acc fp32 [M, N] (zeroed) += the promoted block sum of SPEC 7.2, exactly the reference's:
    d[kb] = fp32(exact fp64 block dot), term = (d * x_scale[m, kb]) * w_scale_inv[n // 128, kb], added to
    acc for kb ascending. One fp64 bmm per (row chunk, 128-column block) computes all K blocks' dots."""
    m, k = x_q.shape
    n = w_q.shape[0]
    kb = cdiv(k, BLOCK)
    if m == 0 or n == 0 or kb == 0:
        return
    xs = x_scale.float()
    ws = w_scale_inv.float()
    for r0 in range(0, m, ROW_CHUNK):
        r1 = min(r0 + ROW_CHUNK, m)
        xb = _blocks64(x_q[r0:r1], kb).transpose(0, 1).contiguous()  # [KB, r, 128]
        xs_t = xs[r0:r1].T.contiguous()[:, :, None]  # [KB, r, 1]
        for nb in range(cdiv(n, BLOCK)):
            n0, n1 = nb * BLOCK, min((nb + 1) * BLOCK, n)
            wb = _blocks64(w_q[n0:n1], kb).permute(1, 2, 0)  # [KB, 128, nc], a transposed view
            size = kb * (r1 - r0) * (n1 - n0)
            d64 = buffer("fp8.d64", size, torch.float64).view(kb, r1 - r0, n1 - n0)
            torch.bmm(xb, wb, out=d64)  # exact block sums
            d = buffer("fp8.d32", size).view(kb, r1 - r0, n1 - n0)
            d.copy_(d64)  # rounded once to fp32, as the reference
            d.mul_(xs_t).mul_(ws[nb][:, None, None])
            out = acc[r0:r1, n0:n1]
            for b in range(kb):
                out.add_(d[b])
