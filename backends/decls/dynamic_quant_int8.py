"""dynamic_quant_int8 (SPEC 2.5): per-row symmetric int8 quantization of activations."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, dim, dtype_of, randn


def dynamic_quant_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] float -> (x_q int8 [M, K], scale fp32 [M])."""


def _fake(a: dict) -> tuple[Tensor, Tensor]:
    x = a["x"]
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


DECL = OpDecl(
    name="dynamic_quant_int8",
    spec_section="2.5",
    signature=dynamic_quant_int8,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=v.check_dynamic_quant_int8,
    fake=_fake,
    sample=lambda g, dt, grad: dict(x=randn(g, 5, 64, dtype=dt)),
    sized=_sized.gemm("dynamic_quant_int8"),
    sharding="columns or rows local",
    quantities={"K": dim("x", 1)},
)
