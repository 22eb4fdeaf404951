"""w8a8_matmul (SPEC 2.6): int8 x int8 GEMM, exact int32 accumulation, per-token x per-channel scales."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, TDTYPE, dim, dtype_of, int8, randn, rows_by_cols


def w8a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """x_q int8 [M, K], x_scale fp32 [M], w_q int8 [N, K], w_scale fp32 [N], bias [N] -> [M, N] out_dtype."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        x_q=int8(g, 5, 64),
        x_scale=randn(g, 5).abs(),
        w_q=int8(g, 7, 64),
        w_scale=randn(g, 7).abs(),
        bias=randn(g, 7),
        out_dtype=TDTYPE[dt],
    )


DECL = OpDecl(
    name="w8a8_matmul",
    spec_section="2.6",
    signature=w8a8_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=v.check_w8a8_matmul,
    fake=rows_by_cols(("x_q", 0), ("w_q", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sized=_sized.gemm("w8a8_matmul"),
    sharding="columns or rows local",
    quantities={"K": dim("x_q", 1), "N": dim("w_q", 0)},
)
