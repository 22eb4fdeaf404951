"""Per-row symmetric dynamic int8 quantization (SPEC 2.5; vLLM int8, torch_npu npu_dynamic_quant).

scale = max(amax_row, 1e-10) / 127
x_q   = clamp(round_half_even(x / scale), -127, 127), 0 where x / scale is NaN
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS


@reference_op("dynamic_quant_int8")
def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()  # [M, K]
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127  # [M] fp32
    q = torch.round(xf / scale[:, None]).clamp(-127, 127)  # torch.round is half-to-even
    x_q = q.nan_to_num(nan=0.0).to(torch.int8)  # a NaN quotient is code 0 (a float->int cast of NaN is UB)
    return x_q, scale


IMPL = OpImpl(dynamic_quant_int8, OpCaps(FLOATS))
