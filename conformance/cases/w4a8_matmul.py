"""Conformance cases for `w4a8_matmul` (SPEC 2.7): per-channel (GLM-5's recipe) and per-group scales,
int4 -8 and int8 -128, K = 7168, odd group counts, strided views. The dtype axis is `out_dtype`.

Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
"""

from __future__ import annotations

import torch

from backends.reference.w4a8_matmul import pack_int4
from conformance.case import Case, Output
from conformance.cases._common import Subset, randint, randn, row_subset, strided, tdtype

OUTPUTS = (Output("out", "ulp"),)


def _case(id: str, build, **kw) -> Case:
    return Case("w4a8_matmul", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g: torch.Generator, m, k, n, group, dt, *, bias=False, w_lo=-8, x_lo=-127):
    return {
        "x_q": randint(g, x_lo, 127, m, k, dtype=torch.int8),
        "x_scale": (torch.rand(m, generator=g) + 0.5) * 0.02,
        "w_packed": pack_int4(randint(g, w_lo, 7, n, k)),
        "w_scale": (torch.rand(n, k // group, generator=g) + 0.5) * 0.05,
        "group_size": group,
        "bias": randn(g, n).to(tdtype(dt)) if bias else None,
        "out_dtype": tdtype(dt),
    }


def _extremes(g, dt):
    a = mk(g, 6, 7168, 16, 7168, dt, x_lo=-128)
    w = randint(g, -8, 7, 16, 7168)
    w[0] = -8
    w[1, ::2] = 7
    a["w_packed"] = pack_int4(w)
    a["x_q"][0] = -128
    return a


def _noncontig(g, dt):
    a = mk(g, 5, 64, 12, 16, dt, bias=True)
    a["x_q"] = strided(a["x_q"])
    a["w_packed"] = strided(a["w_packed"])
    a["w_scale"] = strided(a["w_scale"])
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 4, 32, 8, 16, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case(
        "smoke/m4_k32_n8_g16_bias",
        lambda g, dt: mk(g, 4, 32, 8, 16, dt, bias=True),
        tags={"shape": "M4 K32 N8 g16"},
    ),
    _case("smoke/m3_k64_n6_per_channel", lambda g, dt: mk(g, 3, 64, 6, 64, dt)),
    _case(
        "realistic/expert_up_m16_k6144_n256_per_channel",
        lambda g, dt: mk(g, 16, 6144, 256, 6144, dt),
        tags={"shape": "M16 K6144 N256 per-channel"},
    ),
    _case(
        "realistic/expert_down_m32_k2048_n384_g128",
        lambda g, dt: mk(g, 32, 2048, 384, 128, dt, bias=True),
        tags={"shape": "M32 K2048 N384 g128"},
    ),
    _case("adversarial/int4_min_int8_min_k7168", _extremes, tags={"shape": "M6 K7168 N16"}),
    _case("adversarial/group2", lambda g, dt: mk(g, 5, 24, 7, 2, dt)),
    _case("adversarial/odd_group_count_g24_k72", lambda g, dt: mk(g, 4, 72, 9, 24, dt, bias=True)),
    _case("adversarial/k2", lambda g, dt: mk(g, 6, 2, 5, 2, dt, x_lo=-128)),
    _case("adversarial/noncontig_strided", _noncontig, tags={"layout": "strided"}),
    _case("adversarial/empty_m0", lambda g, dt: mk(g, 0, 32, 8, 16, dt), trivial=True),
    _case(
        "errors/group_size_not_dividing_k",
        _bad(group_size=12),
        error=(ValueError, r"^group_size: expected a divisor"),
    ),
    _case(
        "errors/group_size_zero", _bad(group_size=0), error=(ValueError, r"^group_size: expected an int >= 1")
    ),
    _case(
        "errors/odd_k",
        lambda g, dt: _bad()(g, dt) | {"x_q": torch.zeros(4, 33, dtype=torch.int8)},
        error=(ValueError, r"^x_q: expected an even K"),
    ),
    _case(
        "errors/w_packed_int8",
        _bad(w_packed=lambda a: a["w_packed"].to(torch.int8)),
        error=(ValueError, r"^w_packed: expected dtype"),
    ),
    _case(
        "errors/w_packed_k_mismatch",
        _bad(w_packed=lambda a: a["w_packed"][:, :8]),
        error=(ValueError, r"^w_packed: expected shape"),
    ),
    _case(
        "errors/w_scale_groups",
        _bad(w_scale=lambda a: a["w_scale"][:, :1]),
        error=(ValueError, r"^w_scale: expected shape"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x_q", "x_scale"))
