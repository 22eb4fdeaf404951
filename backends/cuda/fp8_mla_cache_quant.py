"""cuda backend: fp8_mla_cache_quant (SPEC 7.6) -> kernels_cuda.fp8_quant (one program per token x 128-wide
tile; bitwise FlashMLA's quantizer: power-of-two scales from exponent bits, RNE in fp32 before the cast).
Writing rows into a cache is `backends.reference.fp8_mla_cache_quant.write_rows` (one index_put)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from kernels_cuda.fp8_quant import fp8_mla_cache_quant as _kernel


def fp8_mla_cache_quant(kv: torch.Tensor) -> torch.Tensor:
    """kv [N, 576] float -> uint8 [N, 656]. Semantics: backends/reference/fp8_mla_cache_quant.py"""
    return _kernel(kv)


IMPL = OpImpl(fp8_mla_cache_quant, OpCaps(FLOATS))
