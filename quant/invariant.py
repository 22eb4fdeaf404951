"""W8A8 / W4A8 linears in the layout-invariant mode (SPEC 12): the integer products are exact, so a
row-parallel layer (K split over ranks) gives the unsplit layer's bits when

- the activation scale comes from the GLOBAL row max (the max over the group of the ranks' row maxima),
  so every rank quantizes its columns exactly as the unsplit layer would (SPEC 2.5's formula);
- W8A8: the int32 partials are summed over the group by its all-reduce (exact in any order) before the
  one scaling,
  out = (float32(acc) * x_scale[m] * w_scale[n] + bias[n]) (SPEC 2.6);
- W4A8: each group's term float32(acc_g) * w_scale[n, g] is formed where its columns live, the terms are
  gathered in rank order (= the global group order) and summed g = 0, 1, ... as SPEC 2.7 writes;
  out = x_scale[m] * total (+ bias). The gather moves [groups, M, N] fp32 terms, not [M, N].

The same formulas run unsplit, so in the mode a quantized linear's bits do not depend on the backend or
the layout. `forward` is what `quant.modules.QuantLinear.forward` calls while the mode is on.
"""

from __future__ import annotations

import torch

from backends.invariant import engine as invariant
from quant.recipe import W4A8


def _quantize_rows(xf: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 2.5 with the row max taken over the group: (x_q int8, x_scale fp32 [M])."""
    amax = xf.abs().amax(1) if xf.shape[1] else xf.new_zeros(xf.shape[0])
    if group is not None:
        amax = group.all_gather(amax[None], 0).amax(0)
    scale = amax.clamp_min(1e-10) / 127
    q = torch.round(xf / scale[:, None]).clamp(-127, 127).nan_to_num(nan=0.0)
    return q.to(torch.int8), scale


def forward(module, x: torch.Tensor, split: invariant.RowSplit | None = None) -> torch.Tensor:
    """module: a QuantLinear (int_weight, scheme, group_size, bias, out_features); x [..., K_local];
    `split`: the plan's row-parallel split (K over its group), None for a whole layer."""
    group = split.group if split is not None else None
    shape = x.shape
    xq, x_scale = _quantize_rows(x.reshape(-1, shape[-1]).float(), group)
    w, w_scale = module.int_weight()  # int8 [N, K_local], fp32 [N, G_local]
    if module.scheme.name == W4A8:
        gs = module.group_size
        terms = torch.stack(
            [
                invariant.int8_product(xq[:, g * gs : (g + 1) * gs], w[:, g * gs : (g + 1) * gs]).float()
                * w_scale[None, :, g]
                for g in range(w_scale.shape[1])
            ]
        )  # [G_local, M, N]
        if group is not None:
            terms = group.all_gather(terms, 0)
        total = torch.zeros_like(terms[0])
        for term in terms:
            total = total + term
        out = x_scale[:, None] * total
    else:
        acc = invariant.int8_product(xq, w)
        if group is not None:
            acc = group.all_reduce(acc)  # integers: exact in any order, so the group's own all-reduce
        out = acc.float() * x_scale[:, None] * w_scale[None, :, 0]
    if module.bias is not None:
        out = out + module.bias.float()[None, :]
    return out.to(x.dtype).reshape(*shape[:-1], module.out_features)
