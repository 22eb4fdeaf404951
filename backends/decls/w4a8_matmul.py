"""w4a8_matmul (SPEC 2.7): int8 activations x packed signed int4 weights with per-group scales."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, TDTYPE, dim, dtype_of, int8, randn, rows_by_cols, scalar


def w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    group_size: int,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """x_q int8 [M, K], w_packed uint8 [N, K // 2] (w[n, 2i] in the low nibble), w_scale fp32
    [N, K // group_size] -> [M, N] out_dtype."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    from backends.reference.w4a8_matmul import pack_int4

    return dict(
        x_q=int8(g, 5, 64),
        x_scale=randn(g, 5).abs(),
        w_packed=pack_int4(torch.randint(-8, 8, (7, 64), generator=g)),
        w_scale=randn(g, 7, 2).abs(),
        group_size=32,
        bias=None,
        out_dtype=TDTYPE[dt],
    )


DECL = OpDecl(
    name="w4a8_matmul",
    spec_section="2.7",
    signature=w4a8_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=v.check_w4a8_matmul,
    fake=rows_by_cols(("x_q", 0), ("w_packed", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sized=_sized.gemm("w4a8_matmul"),
    sharding="columns or rows local",
    quantities={"K": dim("x_q", 1), "N": dim("w_packed", 0), "group_size": scalar("group_size")},
)
