"""Conformance cases for `fp8_quant_group` (SPEC 7.1): 1 x 128 e4m3 groups with fp32 scales, DeepSeek's
(1e-4) and vLLM's (1e-10) floors, UE8M0 scales, partial last groups, all-zero groups, exact e4m3 ties,
saturation, rows spanning twelve decades. Codes and scales are compared bit for bit.

Semantics: backends/reference/fp8_quant_group.py (SPEC 7.1)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randn, row_subset, strided, tdtype

OUTPUTS = (Output("x_q", "fp8_exact"), Output("scale", "exact"))


def _case(id: str, build, **kw) -> Case:
    return Case("fp8_quant_group", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g, m, k, dt, *, group_size=128, eps=1e-4, ue8m0=False, decades=(-3, 2)):
    x = randn(g, m, k)
    if m:
        x = x * torch.logspace(*decades, m)[:, None]
    return {"x": x.to(tdtype(dt)), "group_size": group_size, "eps": eps, "ue8m0": ue8m0}


def _ties(g, dt):
    """Every e4m3 value and every midpoint between neighbours at scale 1 (group amax 448)."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique()
    mids = (v[1:] + v[:-1]) / 2
    row = torch.cat([v, -v, mids, -mids, torch.tensor([448.0])])
    row = torch.nn.functional.pad(row, (0, -row.numel() % 128))
    x = row.reshape(1, -1).to(tdtype(dt))
    return {"x": x, "group_size": x.shape[1], "eps": 1e-4, "ue8m0": False}


def _zero_and_tiny(g, dt):
    a = mk(g, 4, 256, dt, eps=1e-10)
    a["x"][0] = 0
    a["x"][1, :128] = 1e-30 if dt == "float32" else 0
    a["x"][2] *= 1e-6
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 3, 128, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case("smoke/m4_k256", lambda g, dt: mk(g, 4, 256, dt), tags={"shape": "M4 K256"}),
    _case("smoke/m3_k200_partial_group_ue8m0", lambda g, dt: mk(g, 3, 200, dt, ue8m0=True)),
    _case(
        "realistic/m64_k6144_ue8m0",
        lambda g, dt: mk(g, 64, 6144, dt, ue8m0=True),
        tags={"shape": "M64 K6144"},
    ),
    _case("realistic/m32_k2048_vllm_eps", lambda g, dt: mk(g, 32, 2048, dt, eps=1e-10)),
    _case("adversarial/e4m3_ties_and_every_value", _ties, dtypes=("float32",)),
    _case("adversarial/zero_and_tiny_groups", _zero_and_tiny),
    _case(
        "adversarial/twelve_decades",
        lambda g, dt: mk(g, 13, 384, dt, decades=(-6, 4), eps=1e-10),
        dtypes=("float32", "bfloat16"),
    ),
    _case("adversarial/group_64_k100", lambda g, dt: mk(g, 5, 100, dt, group_size=64)),
    _case("adversarial/k1", lambda g, dt: mk(g, 6, 1, dt)),
    _case("adversarial/strided_x", lambda g, dt: mk(g, 6, 256, dt) | {"x": strided(mk(g, 6, 256, dt)["x"])}),
    _case("adversarial/empty_m0", lambda g, dt: mk(g, 0, 128, dt), trivial=True),
    _case(
        "errors/x_int8", _bad(x=lambda a: a["x"].to(torch.int8)), error=(ValueError, r"^x: expected dtype")
    ),
    _case("errors/x_1d", _bad(x=lambda a: a["x"][0]), error=(ValueError, r"^x: expected 2 dims")),
    _case("errors/eps_zero", _bad(eps=0.0), error=(ValueError, r"^eps: expected a positive")),
    _case("errors/group_size_zero", _bad(group_size=0), error=(ValueError, r"^group_size: expected")),
    _case("errors/ue8m0_str", _bad(ue8m0="yes"), error=(ValueError, r"^ue8m0: expected a bool")),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x",))
