"""cpu backend: fp8_quant_group (SPEC 7.1), bit for bit the reference: the same fp32 amax, floor, division
and saturating e4m3 cast, without its zero-padded copy or per-column scale expansion (full groups are a
view, a partial last group is reduced on its own), in row slices that stay in cache. torch's e4m3 cast is
the rounding rule itself (RNE after the clamp), so it is kept; it bounds the speed.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.formats import BLOCK, E4M3, E4M3_MAX, EPS_DEEPSEEK, cdiv, pow2_ceil

#: elements of x handled per slice (fp32 copies of 1 MiB)
SLICE_ELEMS = 1 << 18


def fp8_quant_group(
    x: torch.Tensor, group_size: int = BLOCK, eps: float = EPS_DEEPSEEK, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q e4m3 [M, K], scale fp32 [M, ceil(K / group_size)]).
    Semantics: backends/reference/fp8_quant_group.py (SPEC 7.1)"""
    m, k = x.shape
    g = cdiv(k, group_size)
    full = k // group_size  # groups of group_size columns; a partial one follows if k % group_size
    x_q = torch.empty(m, k, dtype=E4M3)
    scale = torch.empty(m, g, dtype=torch.float32)
    step = max(1, SLICE_ELEMS // max(1, k))
    for r0 in range(0, m, step):
        r1 = min(r0 + step, m)
        xf = x[r0:r1].to(torch.float32, copy=True)
        amax = torch.empty(r1 - r0, g, dtype=torch.float32)
        if full:
            head = xf[:, : full * group_size].view(r1 - r0, full, group_size)
            torch.amax(head.abs(), dim=-1, out=amax[:, :full])
        if full < g:
            torch.amax(xf[:, full * group_size :].abs(), dim=-1, out=amax[:, full])
        s = torch.clamp(amax, min=eps) / E4M3_MAX
        s = pow2_ceil(s) if ue8m0 else s
        scale[r0:r1] = s
        if full:
            head.div_(s[:, :full, None])
        if full < g:
            xf[:, full * group_size :].div_(s[:, full, None])
        x_q[r0:r1] = xf.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x_q, scale


IMPL = OpImpl(fp8_quant_group, OpCaps(FLOATS))
