"""Per-token-group FP8 activation quantization (SPEC 7.1; DeepSeek `act_quant`, vLLM
`per_token_group_quant_fp8`, SGLang `per_token_group_quant_8bit`).

For row m and group g (columns g*group_size .. min((g+1)*group_size, K); a partial last group uses
its own columns):
    amax      = max(max |x[m, group]|, eps)              eps: 1e-4 DeepSeek (default), 1e-10 vLLM
    s[m, g]   = amax / 448                               fp32 division
    ue8m0:      s[m, g] = 2 ** ceil(log2 s[m, g])        (power of two, rounded up; stored as fp32)
    x_q[m, k] = e4m3(clamp(x[m, k] / s[m, g], -448, 448)) round to nearest even
Dequantization: x ~= x_q * s. NaN in a group gives a NaN scale and NaN codes (as upstream).
DeepSeek's TileLang `act_quant` multiplies amax by fl(1/448) instead of dividing: the same UE8M0 power
for every fp32 amax, but without UE8M0 one ulp apart for about 55% of amax values (SPEC 7.8).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS
from backends.reference.fp8_format import BLOCK, EPS_DEEPSEEK, cast_e4m3, cdiv, expand_groups, group_scale


@reference_op("fp8_quant_group")
def fp8_quant_group(
    x: torch.Tensor, group_size: int = BLOCK, eps: float = EPS_DEEPSEEK, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape  # x: [M, K]
    g = cdiv(k, group_size)
    xf = x.float()
    padded = torch.zeros(m, g * group_size, dtype=torch.float32)
    padded[:, :k] = xf.abs()
    amax = padded.reshape(m, g, group_size).amax(dim=-1)  # [M, G]; NaN propagates
    scale = group_scale(amax, eps, ue8m0)
    x_q = cast_e4m3(xf / expand_groups(scale, k, group_size))
    return x_q, scale


IMPL = OpImpl(fp8_quant_group, OpCaps(FLOATS))
