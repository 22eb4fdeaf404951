"""Conformance cases for `fp8_mla_cache_quant` (SPEC 7.6): FlashMLA's 656-byte V3.2 rows (512 e4m3 | 4 fp32
power-of-two scales | 64 bf16 RoPE) from FlashMLA's decode-test values, tiles at the 1e-4 scale floor,
an amax exactly at a power of two times 448, large and tiny tiles, strided input. Bytes compared exactly.

Semantics: backends/reference/fp8_mla_cache_quant.py (SPEC 7.6)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randn, row_subset, strided, tdtype

OUTPUTS = (Output("rows", "exact"),)


def _case(id: str, build, **kw) -> Case:
    return Case("fp8_mla_cache_quant", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g, n, dt, scale=0.1):
    return {"kv": (randn(g, n, 576) * scale).clamp(-1, 1).to(tdtype(dt))}


def _edges(g, dt):
    a = mk(g, 6, dt)
    kv = a["kv"]
    kv[0, :128] = 0  # floor: scale 2^ceil(log2 1e-4)
    kv[1, 128:256] *= 1e-4
    kv[2, 256] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two: no rounding up
    kv[3, 384:512] *= 100.0
    kv[4, 512:] = 1e30 if dt == "float32" else 1e4  # RoPE is stored as bf16, not quantized
    return a


CASES = [
    _case("smoke/n5", lambda g, dt: mk(g, 5, dt)),
    _case("realistic/n2048", lambda g, dt: mk(g, 2048, dt), tags={"shape": "N2048 (one prefill chunk)"}),
    _case("adversarial/scale_floor_pow2_edges", _edges),
    _case("adversarial/wide_range", lambda g, dt: mk(g, 9, dt, scale=30.0)),
    _case("adversarial/strided_kv", lambda g, dt: {"kv": strided(mk(g, 7, dt)["kv"])}),
    _case("adversarial/empty_n0", lambda g, dt: mk(g, 0, dt), trivial=True),
    _case(
        "errors/kv_width",
        lambda g, dt: {"kv": mk(g, 3, dt)["kv"][:, :512]},
        error=(ValueError, r"^kv: expected shape \[N, 576\]"),
    ),
    _case(
        "errors/kv_int",
        lambda g, dt: {"kv": mk(g, 3, dt)["kv"].to(torch.int32)},
        error=(ValueError, r"^kv: expected dtype"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("kv",))
