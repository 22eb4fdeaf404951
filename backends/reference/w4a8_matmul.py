"""W4A8 GEMM with per-group scales (SPEC 2.7).

Packing: byte w_packed[n, i] holds w[n, 2i] in its low nibble and w[n, 2i+1] in its high nibble,
signed int4 in [-8, 7].

    acc_g[m, n] = sum_{k in group g} int32(x_q[m, k]) * int32(w[n, k])   exact
    out[m, n]   = x_scale[m] * sum_g float32(acc_g[m, n]) * w_scale[n, g] (+ bias[n]) -> out_dtype

The fp32 sum over groups runs in group order g = 0, 1, ...
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS
from backends.reference.w8a8_matmul import int_matmul_exact


def unpack_int4(w_packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K//2] -> int8 [..., K] in [-8, 7] (low nibble first). The one int4 unpacking every
    backend and `quant` use (by `backends.formats`); shifts sign-extend, 5x faster than mask-and-select."""
    lo = (w_packed << 4).view(torch.int8) >> 4
    hi = w_packed.view(torch.int8) >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_int4(w: torch.Tensor) -> torch.Tensor:
    """int [..., K] in [-8, 7] (K even) -> uint8 [..., K//2]; inverse of unpack_int4."""
    if w.shape[-1] % 2:
        raise ValueError(f"w: expected an even last dim, got shape {list(w.shape)}")
    if w.numel() and (int(w.min()) < -8 or int(w.max()) > 7):
        raise ValueError(f"w: expected values in [-8, 7], got range [{int(w.min())}, {int(w.max())}]")
    u = (w.to(torch.int16) & 0x0F).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


@reference_op("w4a8_matmul")
def w4a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    w = unpack_int4(w_packed)  # [N, K] int8
    m, n = x_q.shape[0], w.shape[0]
    total = torch.zeros(m, n, dtype=torch.float32)
    for g in range(x_q.shape[1] // group_size):
        cols = slice(g * group_size, (g + 1) * group_size)
        acc_g = int_matmul_exact(x_q[:, cols], w[:, cols])  # [M, N], exact
        total = total + acc_g.float() * w_scale[None, :, g]
    out = x_scale[:, None] * total
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


IMPL = OpImpl(w4a8_matmul, OpCaps(FLOATS))
