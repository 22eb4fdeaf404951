"""W4A8 GEMM with per-group scales (SPEC 2.7).

Packing: byte w_packed[n, i] holds w[n, 2i] in its low nibble and w[n, 2i+1] in its high nibble,
signed int4 in [-8, 7].

    acc_g[m, n] = sum_{k in group g} int32(x_q[m, k]) * int32(w[n, k])   exact
    out[m, n]   = x_scale[m] * sum_g float32(acc_g[m, n]) * w_scale[n, g] (+ bias[n]) -> out_dtype

The fp32 sum over groups runs in group order g = 0, 1, ...
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import check_epilogue, check_group_size, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import FLOATS, TDTYPE, dim, dtype_of, int8, randn, rows_by_cols, scalar
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
    """x_q int8 [M, K], w_packed uint8 [N, K // 2] (w[n, 2i] in the low nibble), w_scale fp32
    [N, K // group_size] -> [M, N] out_dtype."""
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


def check(x_q, x_scale, w_packed, w_scale, group_size, bias, out_dtype) -> None:
    check_tensor("x_q", x_q, dtype=torch.int8, ndim=2)
    m, k = x_q.shape
    if k % 2:
        fail("x_q", "an even K (two int4 weights per byte)", f"shape {list(x_q.shape)}")
    check_tensor("w_packed", w_packed, dtype=torch.uint8, ndim=2)
    if w_packed.shape[1] != k // 2:
        fail("w_packed", f"shape [N, K//2={k // 2}]", f"shape {list(w_packed.shape)}")
    n = w_packed.shape[0]
    check_group_size(k, group_size)
    check_epilogue(m, n, x_scale, (n, k // group_size), w_scale, bias, out_dtype, x_q=x_q, w_packed=w_packed)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        x_q=int8(g, 5, 64),
        x_scale=randn(g, 5).abs(),
        w_packed=pack_int4(torch.randint(-8, 8, (7, 64), generator=g)),
        w_scale=randn(g, 7, 2).abs(),
        group_size=32,
        bias=None,
        out_dtype=TDTYPE[dt],
    )


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with `quantity` ("K", "N" or "group_size") at v."""
    gs = v if quantity == "group_size" else 32
    k, n = (v if quantity == "K" else 2 * gs), (v if quantity == "N" else 8)
    k += k % 2
    gs = gs if k % gs == 0 else k
    return dict(
        x_q=int8(g, 3, k),
        x_scale=torch.rand(3, generator=g),
        w_packed=torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
        w_scale=torch.rand(n, k // gs, generator=g),
        group_size=gs,
        bias=None,
        out_dtype=TDTYPE.get(dt, torch.float32),
    )


DECL = OpDecl(
    name="w4a8_matmul",
    spec_section="2.7",
    signature=w4a8_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=check,
    fake=rows_by_cols(("x_q", 0), ("w_packed", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sized=sized,
    sharding="columns or rows local",
    quantities={"K": dim("x_q", 1), "N": dim("w_packed", 0), "group_size": scalar("group_size")},
)
IMPL = OpImpl(w4a8_matmul, OpCaps(FLOATS))
