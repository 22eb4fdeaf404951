"""Conformance cases for `silu_and_mul` (SPEC 2.10): GLM-5's expert and dense intermediate widths, large
and tiny gates (sigmoid saturating both ways), non-finite inputs, an odd width refused, gradients in x.

Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randn, row_subset, strided, tdtype

#: fp32 sigmoid and products differ by a few ulp between libraries (exp is not correctly rounded): SPEC 4's
#: default elementwise tolerance
OUTPUTS = (Output("out", "default"),)


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("silu_and_mul", id, build, **kw)
    return Case("silu_and_mul", id, build, OUTPUTS, grad_args=kw.pop("grad_args", ("x",)), **kw)


def mk(g: torch.Generator, m: int, n: int, dt: str, *, scale: float = 1.0) -> dict:
    return {"x": randn(g, m, 2 * n, scale=scale).to(tdtype(dt))}


def _saturating(g, dt):
    x = mk(g, 4, 64, dt)["x"].float()
    x[:, :64] = torch.linspace(-60, 60, 64)  # sigmoid 0 and 1 in fp32 at the ends; silu(-60) = -0.0...
    return {"x": x.to(tdtype(dt))}


def _non_finite(g, dt):
    x = mk(g, 3, 8, dt)["x"]
    x[0, 0], x[1, 1], x[2, 8] = float("inf"), float("-inf"), float("nan")
    return {"x": x}


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x",))


CASES = [
    _case("smoke/m8_n64", lambda g, dt: mk(g, 8, 64, dt), tags={"shape": "M8 N64"}),
    _case("realistic/m32_n2048_expert", lambda g, dt: mk(g, 32, 2048, dt), tags={"shape": "M32 N2048"}),
    _case("realistic/m4_n12288_dense", lambda g, dt: mk(g, 4, 12288, dt), tags={"shape": "M4 N12288"}),
    _case("adversarial/saturating_gates", _saturating),
    _case("adversarial/non_finite", _non_finite, grad_args=()),
    _case(
        "adversarial/strided_x",
        lambda g, dt: {"x": strided(mk(g, 5, 40, dt)["x"])},
        tags={"layout": "strided"},
    ),
    _case("adversarial/m1_n1", lambda g, dt: mk(g, 1, 1, dt)),
    _case("adversarial/empty_m0", lambda g, dt: mk(g, 0, 16, dt), trivial=True, grad_args=()),
    _case(
        "errors/odd_width",
        lambda g, dt: {"x": randn(g, 2, 7).to(tdtype(dt))},
        error=(ValueError, r"^x: expected an even last dimension"),
    ),
    _case(
        "errors/integer_x",
        lambda g, dt: {"x": torch.ones(2, 8, dtype=torch.int32)},
        error=(ValueError, r"^x: expected dtype"),
    ),
]
