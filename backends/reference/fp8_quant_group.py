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
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_int, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import E4M3, FLOATS, dim, dtype_of, randn, scalar
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


def check(x, group_size, eps, ue8m0) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    check_int("group_size", group_size, min_value=1)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < float(eps) < float("inf")):
        fail("eps", "a positive finite float (1e-4 DeepSeek, 1e-10 vLLM)", eps)
    if not isinstance(ue8m0, bool):
        fail("ue8m0", "a bool", type(ue8m0).__name__)


def fake(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = a["x"]
    groups = -(-x.shape[1] // a["group_size"])
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], groups), dtype=torch.float32)


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with `quantity` ("group_size" or "K") at v."""
    gs = v if quantity == "group_size" else 128
    k = v if quantity == "K" else 2 * gs
    return dict(
        x=randn(g, 3, k, dtype=dt if dt in FLOATS else "float32"), group_size=gs, eps=1e-4, ue8m0=False
    )


DECL = OpDecl(
    name="fp8_quant_group",
    spec_section="7.1",
    signature=fp8_quant_group,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=check,
    fake=fake,
    sample=lambda g, dt, grad: dict(x=randn(g, 3, 200, dtype=dt), group_size=128, eps=1e-4, ue8m0=False),
    sized=sized,
    sharding="columns or rows local",
    quantities={"group_size": scalar("group_size"), "K": dim("x", 1)},
)
IMPL = OpImpl(fp8_quant_group, OpCaps(FLOATS))
