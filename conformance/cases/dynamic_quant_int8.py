"""Conformance cases for `dynamic_quant_int8` (SPEC 2.5): activation rows of GLM-5's hidden size,
exact round-half-to-even ties, all-zero and tiny rows, extremes of each float type, NaN and infinite
rows, strided views.

Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randn, row_subset, strided, tdtype, transposed

OUTPUTS = (Output("x_q", "exact"), Output("scale", "exact"))


def _case(id: str, build, **kw) -> Case:
    return Case("dynamic_quant_int8", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def _x(g, m, k, dt, scale=1.0):
    return {"x": randn(g, m, k, scale=scale).to(tdtype(dt))}


def _half_ties(g, dt):
    # amax 127 makes scale exactly 1.0, so x / scale lands on n + 0.5: half-to-even vs half-away differ
    x = (torch.randint(-126, 126, (6, 64), generator=g) + 0.5).float()
    x[:, 0] = 127.0
    x[1::2, 0] = -127.0
    x[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -126.5])
    return {"x": x.to(tdtype(dt))}


def _zero_tiny(g, dt):
    x = randn(g, 5, 48)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = 1e-12 if dt == "float32" else 0.0  # amax below the 1e-10 clamp
    x[3, 5] = 0.0
    x[3] = x[3] * 1e-3
    return {"x": x.to(tdtype(dt))}


def _extremes(g, dt):
    fi = torch.finfo(tdtype(dt))
    x = randn(g, 4, 40)
    x[0] = x[0] / x[0].abs().max() * fi.max * 0.99
    x[1] = fi.tiny * torch.sign(x[1])  # smallest normals
    x[2] = fi.tiny * x[2] * 4  # around the subnormal range
    x[3] = torch.full((40,), 3.0)
    x[3, 7] = -3.0
    return {"x": x.to(tdtype(dt))}


def _nan_inf_rows(g, dt):
    # a NaN anywhere in a row makes its scale NaN and its codes 0 (amax propagates NaN; ORT's ReduceMax
    # and PTX max drop it); an infinite amax gives scale inf and codes 0
    x = randn(g, 5, 24)
    x[0, 3] = float("nan")
    x[1] = float("nan")
    x[2, 7] = float("inf")
    x[3, 0] = float("-inf")
    return {"x": x.to(tdtype(dt))}


CASES = [
    _case("smoke/random_m4_k32", lambda g, dt: _x(g, 4, 32, dt), tags={"shape": "M4 K32"}),
    _case(
        "realistic/hidden_m64_k6144",
        lambda g, dt: _x(g, 64, 6144, dt, scale=3.0),
        tags={"shape": "M64 K6144"},
    ),
    _case(
        "realistic/moe_inter_m200_k2048",
        lambda g, dt: _x(g, 200, 2048, dt, scale=0.2),
        tags={"shape": "M200 K2048"},
    ),
    _case("adversarial/round_half_even_ties", _half_ties, tags={"shape": "M6 K64"}),
    _case("adversarial/zero_and_tiny_rows", _zero_tiny),
    _case("adversarial/dtype_extremes", _extremes),
    _case("adversarial/nan_and_inf_rows", _nan_inf_rows),
    _case("adversarial/constant_rows", lambda g, dt: {"x": torch.full((3, 17), -2.25, dtype=tdtype(dt))}),
    _case("adversarial/k1", lambda g, dt: _x(g, 9, 1, dt)),
    _case(
        "adversarial/noncontig_transposed",
        lambda g, dt: {"x": transposed(randn(g, 24, 40).to(tdtype(dt)))},
        tags={"layout": "transposed"},
    ),
    _case(
        "adversarial/noncontig_strided",
        lambda g, dt: {"x": strided(randn(g, 7, 33).to(tdtype(dt)))},
        tags={"layout": "strided"},
    ),
    _case("adversarial/empty_m0", lambda g, dt: {"x": torch.empty(0, 16, dtype=tdtype(dt))}, trivial=True),
    _case(
        "errors/x_1d",
        lambda g, dt: {"x": randn(g, 8).to(tdtype(dt))},
        error=(ValueError, r"^x: expected 2 dims"),
    ),
    _case(
        "errors/x_int8",
        lambda g, dt: {"x": torch.zeros(2, 8, dtype=torch.int8)},
        error=(ValueError, r"^x: expected dtype"),
        dtypes=("float32",),
    ),
    _case(
        "errors/k0",
        lambda g, dt: {"x": torch.empty(3, 0, dtype=tdtype(dt))},
        error=(ValueError, r"^x: expected shape \[M, K\] with K >= 1"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x",))
