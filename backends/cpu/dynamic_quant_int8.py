"""cpu backend: dynamic_quant_int8 (SPEC 2.5), the reference's arithmetic with one pass for the row range.

Bitwise the reference's x_q and scale: the same fp32 division and round-half-even; |x|'s row maximum is
max(amax, -amin), which is the same number (negation and abs are exact, NaN propagates in both).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float. Returns (x_q int8 [M, K], scale float32 [M]).
    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
    """
    xf = x.float()
    if x.shape[1] == 0:
        amax = xf.abs().amax(dim=1) if x.shape[0] == 0 else torch.zeros(x.shape[0])
    else:
        lo, hi = torch.aminmax(xf, dim=1)
        amax = torch.maximum(hi, lo.neg())
    scale = amax.clamp_min(1e-10) / 127
    q = xf / scale[:, None]
    return q.round_().clamp_(-127, 127).nan_to_num_(nan=0.0).to(torch.int8), scale


IMPL = OpImpl(dynamic_quant_int8, OpCaps(FLOATS, run_to_run=True, batch_invariant=True))
