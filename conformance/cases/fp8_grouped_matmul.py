"""Conformance cases for `fp8_grouped_matmul` (SPEC 7.3): GLM-5 FP8 experts (K 6144 -> N 2048 gate/up,
K 2048 -> N 6144 down, scaled down in the realistic suite), empty experts, one-row experts, partial N / K
blocks, skewed routing. Comparator fp8_gemm (SPEC 7.2 tolerance, per expert).

Semantics: backends/reference/fp8_grouped_matmul.py (SPEC 7.3)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, pick_rows, tdtype
from conformance.cases._fp8 import activations, weights
from conformance.cases.grouped_matmul import offsets

OUTPUTS = (Output("out", "fp8_gemm"),)


def _case(id: str, build, **kw) -> Case:
    return Case("fp8_grouped_matmul", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g, counts: Sequence[int], k: int, n: int, dt, *, ue8m0=True):
    m = sum(counts)
    x_q, x_s = activations(g, m, k, ue8m0=ue8m0)
    w_q, w_s = weights(g, len(counts), n, k)
    return {
        "x_q": x_q,
        "x_scale": x_s,
        "w_q": w_q,
        "w_scale_inv": w_s,
        "group_offsets": offsets(counts),
        "out_dtype": tdtype(dt),
    }


def _bad(**over):
    def build(g, dt):
        a = mk(g, [2, 0, 3], 256, 128, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


def _padded(g, dt):
    """Expert parallel's masked layout: 3 rows of padding past the last offset (zero, never multiplied)."""
    a = mk(g, [2, 0, 3], 256, 128, dt)
    a["x_q"] = torch.cat([a["x_q"], a["x_q"][:3]])
    a["x_scale"] = torch.cat([a["x_scale"], a["x_scale"][:3]])
    return a


CASES = [
    _case("smoke/e3_k256_n128_empty_expert", lambda g, dt: mk(g, [2, 0, 3], 256, 128, dt)),
    _case("adversarial/rows_past_last_offset", _padded, tags={"layout": "padded"}),
    _case("smoke/e2_k200_n130_partial", lambda g, dt: mk(g, [3, 4], 200, 130, dt, ue8m0=False)),
    _case(
        "realistic/gate_up_e8_k6144_n256",
        lambda g, dt: mk(g, [5, 0, 9, 1, 3, 0, 7, 2], 6144, 256, dt),
        tags={"shape": "E8 M27 K6144 N256"},
    ),
    _case(
        "realistic/down_e4_k2048_n512",
        lambda g, dt: mk(g, [6, 2, 0, 8], 2048, 512, dt),
        tags={"shape": "E4 M16 K2048 N512"},
    ),
    _case("adversarial/one_expert_takes_all", lambda g, dt: mk(g, [0, 0, 40, 0], 384, 128, dt)),
    _case("adversarial/one_row_experts", lambda g, dt: mk(g, [1] * 9, 128, 144, dt)),
    _case("adversarial/all_experts_empty", lambda g, dt: mk(g, [0, 0, 0], 256, 128, dt), trivial=True),
    _case(
        "adversarial/int64_offsets",
        lambda g, dt: mk(g, [3, 5], 256, 128, dt) | {"group_offsets": offsets([3, 5], torch.int64)},
    ),
    _case("errors/w_q_2d", _bad(w_q=lambda a: a["w_q"][0]), error=(ValueError, r"^w_q: expected 3 dims")),
    _case(
        "errors/w_scale_inv_shape",
        _bad(w_scale_inv=lambda a: a["w_scale_inv"][:, :, :1]),
        error=(ValueError, r"^w_scale_inv: expected shape"),
    ),
    _case(
        "errors/offsets_length",
        _bad(group_offsets=lambda a: a["group_offsets"][:3]),
        error=(ValueError, r"^group_offsets: expected shape"),
    ),
    _case(
        "errors/x_q_float", _bad(x_q=lambda a: a["x_q"].float()), error=(ValueError, r"^x_q: expected dtype")
    ),
]


def batch_subset(args: dict) -> Subset:
    """The second half of every expert's rows, run alone."""
    offs = args["group_offsets"].tolist()
    keep = [r for e in range(len(offs) - 1) for r in range((offs[e] + offs[e + 1]) // 2, offs[e + 1])]
    if not keep or len(keep) == offs[-1]:
        return None
    idx = torch.tensor(keep)
    counts = [offs[e + 1] - (offs[e] + offs[e + 1]) // 2 for e in range(len(offs) - 1)]
    sub = dict(
        args,
        x_q=args["x_q"][idx],
        x_scale=args["x_scale"][idx],
        group_offsets=offsets(counts, args["group_offsets"].dtype),
    )
    return sub, lambda out: pick_rows(out, lambda t: t[idx])
