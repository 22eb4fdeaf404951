"""fp8_mla_cache_quant (SPEC 7.6): FlashMLA V3.2's 656-byte FP8 cache rows from 576-wide latent rows."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls._common import FLOATS, dtype_of, randn


def fp8_mla_cache_quant(kv: Tensor) -> Tensor:
    """kv [N, 576] float -> uint8 [N, 656]."""


DECL = OpDecl(
    name="fp8_mla_cache_quant",
    spec_section="7.6",
    signature=fp8_mla_cache_quant,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("kv"),
    validate=v8.check_fp8_mla_cache_quant,
    fake=lambda a: a["kv"].new_empty((a["kv"].shape[0], 656), dtype=torch.uint8),
    sample=lambda g, dt, grad: dict(kv=randn(g, 3, 576, dtype=dt)),
    sharding="unsplit",
)
