"""Conformance cases for `w8a8_matmul` (SPEC 2.6): GLM-5 projection shapes (K up to 7168), int8 -128,
accumulators past 2^24 (fp32 accumulation is not exact there), bias, strided and transposed weights.
The dtype axis is `out_dtype`.

Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randint, randn, row_subset, strided, tdtype, transposed

OUTPUTS = (Output("out", "ulp"),)


def _case(id: str, build, **kw) -> Case:
    return Case("w8a8_matmul", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g: torch.Generator, m, k, n, dt, *, bias=False, lo=-127, hi=127, x_scale=0.02, w_scale=0.01):
    a = {
        "x_q": randint(g, lo, hi, m, k, dtype=torch.int8),
        "x_scale": (torch.rand(m, generator=g) + 0.5) * x_scale,
        "w_q": randint(g, lo, hi, n, k, dtype=torch.int8),
        "w_scale": (torch.rand(n, generator=g) + 0.5) * w_scale,
        "bias": randn(g, n).to(tdtype(dt)) if bias else None,
        "out_dtype": tdtype(dt),
    }
    return a


def _extremes(g, dt):
    # acc[0, 0] = 7168 * 16384 ~ 2^26.8 (int8 -128 squared); acc[1, 2] = 7168 * 127^2: odd terms past
    # 2^24, exact in int32 but not if a kernel accumulates in fp32
    a = mk(g, 8, 7168, 16, dt, lo=-128, hi=127, x_scale=1e-4, w_scale=1e-4)
    a["x_q"][0] = -128
    a["w_q"][0] = -128
    a["x_q"][1] = 127
    a["w_q"][2] = 127
    return a


def _bias_dtype(g, dt):
    a = mk(g, 5, 64, 12, dt)
    a["bias"] = randn(g, 12).to(torch.float32 if dt != "float32" else torch.bfloat16)
    return a


def _noncontig(g, dt):
    a = mk(g, 6, 96, 20, dt, bias=True)
    a["w_q"] = transposed(a["w_q"])
    a["x_q"] = strided(a["x_q"])
    a["x_scale"] = strided(a["x_scale"][None])[0]
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 4, 32, 8, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case("smoke/m4_k32_n8_bias", lambda g, dt: mk(g, 4, 32, 8, dt, bias=True), tags={"shape": "M4 K32 N8"}),
    _case("smoke/m3_k64_n5", lambda g, dt: mk(g, 3, 64, 5, dt)),
    _case(
        "realistic/q_a_proj_m16_k6144_n256",
        lambda g, dt: mk(g, 16, 6144, 256, dt),
        tags={"shape": "M16 K6144 N256"},
    ),
    _case(
        "realistic/o_proj_m48_k2048_n512_bias",
        lambda g, dt: mk(g, 48, 2048, 512, dt, bias=True),
        tags={"shape": "M48 K2048 N512"},
    ),
    _case("adversarial/int8_min_acc_past_2p24_k7168", _extremes, tags={"shape": "M8 K7168 N16"}),
    _case("adversarial/bias_other_float_dtype", _bias_dtype),
    _case("adversarial/zero_scales", lambda g, dt: _bad(x_scale=lambda a: a["x_scale"] * 0)(g, dt)),
    _case("adversarial/k1", lambda g, dt: mk(g, 7, 1, 9, dt, lo=-128)),
    _case("adversarial/noncontig_views", _noncontig, tags={"layout": "transposed w, strided x"}),
    _case("adversarial/empty_m0", lambda g, dt: mk(g, 0, 32, 8, dt), trivial=True),
    _case(
        "errors/x_q_float", _bad(x_q=lambda a: a["x_q"].float()), error=(ValueError, r"^x_q: expected dtype")
    ),
    _case(
        "errors/w_q_k_mismatch",
        _bad(w_q=lambda a: a["w_q"][:, :16]),
        error=(ValueError, r"^w_q: expected shape"),
    ),
    _case(
        "errors/x_scale_shape",
        _bad(x_scale=lambda a: a["x_scale"][:3]),
        error=(ValueError, r"^x_scale: expected"),
    ),
    _case(
        "errors/w_scale_bf16",
        _bad(w_scale=lambda a: a["w_scale"].bfloat16()),
        error=(ValueError, r"^w_scale: expected dtype"),
    ),
    _case(
        "errors/w_q_other_device",
        _bad(w_q=lambda a: a["w_q"].to("meta")),
        error=(ValueError, r"^w_q: expected device"),
    ),
    _case(
        "errors/bias_shape", _bad(bias=lambda a: torch.zeros(7)), error=(ValueError, r"^bias: expected shape")
    ),
    _case("errors/out_dtype_int", _bad(out_dtype=torch.int32), error=(ValueError, r"^out_dtype: expected")),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x_q", "x_scale"))
