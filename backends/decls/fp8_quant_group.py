"""fp8_quant_group (SPEC 7.1): per-token-group e4m3 quantization (DeepSeek / vLLM's per_token_group_quant)."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import E4M3, FLOATS, dim, dtype_of, randn, scalar


def fp8_quant_group(
    x: Tensor, group_size: int = 128, eps: float = 1e-4, ue8m0: bool = False
) -> tuple[Tensor, Tensor]:
    """x [M, K] float -> (x_q e4m3 [M, K], scale fp32 [M, ceil(K / group_size)])."""


def _fake(a: dict) -> tuple[Tensor, Tensor]:
    x = a["x"]
    groups = -(-x.shape[1] // a["group_size"])
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], groups), dtype=torch.float32)


DECL = OpDecl(
    name="fp8_quant_group",
    spec_section="7.1",
    signature=fp8_quant_group,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=v8.check_fp8_quant_group,
    fake=_fake,
    sample=lambda g, dt, grad: dict(x=randn(g, 3, 200, dtype=dt), group_size=128, eps=1e-4, ue8m0=False),
    sized=_sized.fp8_quant_group,
    sharding="columns or rows local",
    quantities={"group_size": scalar("group_size"), "K": dim("x", 1)},
)
