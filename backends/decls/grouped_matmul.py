"""grouped_matmul (SPEC 2.8): the MoE expert GEMM over expert-sorted rows (float, W8A8 and W4A8)."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, dim, dtype_name, randn, rows_by_cols, scalar


def grouped_matmul(
    x: Tensor,
    w: Tensor,
    group_offsets: Tensor,
    x_scale: Tensor | None = None,
    w_scale: Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Rows group_offsets[e]:group_offsets[e+1] of x [M, K] times w[e]^T ([E, N, K]) -> [M, N]."""


def _dtype(a: dict) -> str:
    if a["x"].dtype == torch.int8:
        return "w8a8" if a["w"].dtype == torch.int8 else "w4a8"
    return dtype_name(a["x"].dtype)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        x=randn(g, 9, 32, dtype=dt, grad=grad),
        w=randn(g, 3, 16, 32, dtype=dt, grad=grad),
        group_offsets=torch.tensor([0, 4, 4, 9]),
        x_scale=None,
        w_scale=None,
        group_size=None,
        out_dtype=None,
    )


DECL = OpDecl(
    name="grouped_matmul",
    spec_section="2.8",
    signature=grouped_matmul,
    dtype_axis=FLOATS + ("w8a8", "w4a8"),
    dtype_of=_dtype,
    validate=v.check_grouped_matmul,
    values=v.values_grouped_matmul,
    fake=rows_by_cols(("x", 0), ("w", 1), lambda a: a["out_dtype"] or a["x"].dtype),
    sample=sample,
    sized=_sized.gemm("grouped_matmul"),
    sharding="experts or intermediate local",
    grad_args=("x", "w"),  # the float variant (integer tensors carry no gradient)
    quantities={"K": dim("x", 1), "experts": dim("w", 0), "group_size": scalar("group_size")},
    unchecked=v.unchecked_offsets("x"),
)
