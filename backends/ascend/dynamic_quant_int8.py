"""ascend backend: dynamic_quant_int8 (SPEC 2.5) -> torch_npu.npu_dynamic_quant (bf16/fp16 rows) or
kernels_ascend.dynamic_quant_int8 (fp32 rows, which the operator does not take).

The operator computes scale = amax / 127 with no floor; the contract floors amax at 1e-10 (all-zero
rows give x_q = 0, scale = 1e-10 / 127). The adapter redoes exactly those rows (amax < 1e-10) with
the floored scale, in plain torch: same division, same round-half-even.
Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
"""

from __future__ import annotations

import torch

from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS

OP = "npu_dynamic_quant"
_FLOOR = 1e-10


def floor_tiny_rows(
    x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Redo the rows whose amax is below the contract's floor (the operator's scale has none)."""
    tiny = x.float().abs().amax(dim=1) < _FLOOR  # NaN rows keep the operator's (NaN) scale
    if bool(tiny.any()):
        s = torch.tensor(_FLOOR, dtype=torch.float32, device=x.device) / 127
        x_q = x_q.clone()
        x_q[tiny] = torch.round(x[tiny].float() / s).clamp(-127, 127).to(torch.int8)
        scale = torch.where(tiny, s, scale)
    return x_q, scale


def impl(provider: OpsProvider) -> OpImpl:
    def dynamic_quant_int8(x):
        if x.dtype == torch.float32:
            from kernels_ascend.dynamic_quant_int8 import dynamic_quant_int8 as kernel

            provider.record("dynamic_quant_int8", provider.kernel_label("dynamic_quant_int8"))
            return kernel(x)
        provider.record("dynamic_quant_int8", provider.label(OP))
        x_q, scale = provider.call(OP, x)
        return floor_tiny_rows(x, x_q, scale)

    return OpImpl(dynamic_quant_int8, OpCaps(FLOATS))
