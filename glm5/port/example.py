"""The first op ported in docs/porting.md, the generated README and tests/port: one text, so the guide's
example is the one the test proves."""

from __future__ import annotations

EXAMPLE_OP_NAME = "dynamic_quant_int8"

#: the whole of `glm5_<name>/dynamic_quant_int8.py` once ported, delegating to plain torch
EXAMPLE_OP = '''"""dynamic_quant_int8 (SPEC 2.5) in plain torch: per-row symmetric int8, half to even."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    x_q = torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return x_q, scale


IMPL = OpImpl(dynamic_quant_int8, OpCaps(dtypes=("float32", "bfloat16", "float16")))
'''
