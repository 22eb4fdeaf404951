"""Conformance cases for `grouped_matmul` (SPEC 2.8): MoE expert GEMMs over expert-sorted rows with 8-16
experts including empty ones, every variant of the dtype axis (bf16/fp16/fp32 weights, W8A8, W4A8).

Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.reference.w4a8_matmul import pack_int4
from conformance.case import Case, Output
from conformance.cases._common import Subset, pick_rows, randint, randn, strided, tdtype

FLOATS = ("float32", "bfloat16", "float16")


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("grouped_matmul", id, build, **kw)
    # float variants round an fp32 accumulation once; quantized ones are within 1 ulp of out_dtype (SPEC 4);
    # gradients of x and w (float variants: the integer ones carry none) where the backend differentiates
    grads = () if id.startswith("realistic/") else ("x", "w")
    return Case("grouped_matmul", id, build, (Output("out", "grouped"),), grad_args=grads, **kw)


def offsets(counts: Sequence[int], dtype=torch.int32) -> torch.Tensor:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return torch.tensor(out, dtype=dtype)


def mk(
    g, counts: Sequence[int], k: int, n: int, dt: str, *, group: int | None = None, out_dtype=torch.bfloat16
):
    m, e = sum(counts), len(counts)
    offs = offsets(counts)
    if dt in FLOATS:
        return {
            "x": randn(g, m, k, scale=k**-0.5).to(tdtype(dt)),
            "w": randn(g, e, n, k).to(tdtype(dt)),
            "group_offsets": offs,
        }
    a = {
        "x": randint(g, -127, 127, m, k, dtype=torch.int8),
        "x_scale": (torch.rand(m, generator=g) + 0.5) * 0.02,
        "group_offsets": offs,
        "out_dtype": out_dtype,
    }
    if dt == "w8a8":
        return a | {
            "w": randint(g, -128, 127, e, n, k, dtype=torch.int8),
            "w_scale": (torch.rand(e, n, generator=g) + 0.5) * 0.01,
        }
    group = group or k
    return a | {
        "w": pack_int4(randint(g, -8, 7, e, n, k)),
        "w_scale": (torch.rand(e, n, k // group, generator=g) + 0.5) * 0.05,
        "group_size": group,
    }


def _counts(g, m: int, e: int, empty: Sequence[int]) -> list[int]:
    """m rows over e experts, the experts in `empty` get none (the others at least one)."""
    live = [i for i in range(e) if i not in empty]
    w = torch.rand(len(live), generator=g) + 0.2
    c = (w / w.sum() * (m - len(live))).floor().to(torch.int64) + 1
    c[0] += m - int(c.sum())
    out = [0] * e
    for i, v in zip(live, c.tolist(), strict=True):
        out[i] = v
    return out


def _realistic(g, dt):
    counts = _counts(g, 384, 16, empty=(2, 7, 15))
    return mk(
        g, counts, 2048 if dt in ("w8a8", "w4a8") else 1024, 256, dt, group=128 if dt == "w4a8" else None
    )


def _extremes(g, dt):
    a = mk(g, [3, 0, 5, 1], 64, 16, dt, group=16)
    if dt == "w8a8":
        a["x"][0] = -128
        a["w"][2] = -128
    elif dt == "w4a8":
        a["x"][:, ::3] = -128
        a["w"] = pack_int4(torch.full((4, 16, 64), -8))
    return a


def _noncontig(g, dt):
    a = mk(g, [2, 5, 0, 3], 48, 12, dt, group=16)
    a["x"] = strided(a["x"])
    return a


def _int64_offsets(g, dt):
    a = mk(g, [4, 0, 0, 6, 1], 32, 8, dt, group=16)
    a["group_offsets"] = a["group_offsets"].to(torch.int64)
    return a


def _padded(g, dt):
    """Expert-parallel's masked layout: 5 rows of padding after the last expert's rows (SPEC 2.8: zero in
    the output, no FLOPs), filled with values a backend must not multiply into a real row."""
    a = mk(g, [3, 0, 4], 32, 16, dt, group=16)
    pad = a["x"][:5].clone()
    a["x"] = torch.cat([a["x"], pad])
    if "x_scale" in a:
        a["x_scale"] = torch.cat([a["x_scale"], a["x_scale"][:5]])
    return a


def _float_out(g, dt):
    return mk(g, [3, 2], 32, 8, dt, group=16, out_dtype=torch.float32)


def _bad(**over):
    def build(g, dt):
        a = mk(g, [2, 0, 3], 32, 8, "float32")
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


_Q = ("w8a8", "w4a8")
CASES = [
    _case(
        "smoke/e4_m10_k32_n16_one_empty",
        lambda g, dt: mk(g, [3, 0, 4, 3], 32, 16, dt, group=16),
        tags={"shape": "E4 M10 K32 N16"},
    ),
    _case("realistic/e16_m384_three_empty", _realistic, tags={"shape": "E16 M384 K1024/2048 N256"}),
    _case(
        "realistic/e8_top8_decode_m8",
        lambda g, dt: mk(g, [1] * 8, 2048, 256, dt, group=128),
        tags={"shape": "E8 M8 K2048 N256"},
    ),
    _case(
        "adversarial/all_rows_one_expert", lambda g, dt: mk(g, [0, 0, 9, 0, 0, 0, 0, 0], 40, 24, dt, group=8)
    ),
    _case(
        "adversarial/all_experts_empty_m0", lambda g, dt: mk(g, [0, 0, 0], 16, 8, dt, group=8), trivial=True
    ),
    _case("adversarial/int_extremes", _extremes, dtypes=_Q),
    _case("adversarial/float32_out", _float_out, dtypes=_Q),
    _case("adversarial/int64_offsets", _int64_offsets),
    _case("adversarial/rows_past_last_offset", _padded, tags={"layout": "padded"}),
    _case("adversarial/noncontig_strided_x", _noncontig, tags={"layout": "strided"}),
    _case(
        "errors/offsets_decreasing",
        _bad(group_offsets=torch.tensor([0, 3, 2, 5], dtype=torch.int32)),
        error=(ValueError, r"^group_offsets: expected non-decreasing"),
        dtypes=("float32",),
    ),
    _case(
        "errors/offsets_past_m",
        _bad(group_offsets=torch.tensor([0, 2, 2, 6], dtype=torch.int32)),
        error=(ValueError, r"^group_offsets: expected non-decreasing offsets from 0 to at most M=5"),
        dtypes=("float32",),
    ),
    _case(
        "errors/offsets_wrong_length",
        _bad(group_offsets=torch.tensor([0, 5], dtype=torch.int32)),
        error=(ValueError, r"^group_offsets: expected shape \[4\]"),
        dtypes=("float32",),
    ),
    _case(
        "errors/w_other_device",
        _bad(w=lambda a: a["w"].to("meta")),
        error=(ValueError, r"^w: expected device"),
        dtypes=("float32",),
    ),
    _case(
        "errors/w_dtype_mismatch",
        _bad(w=lambda a: a["w"].bfloat16()),
        error=(ValueError, r"^w: expected dtype"),
        dtypes=("float32",),
    ),
    _case(
        "errors/scale_for_float_x",
        _bad(x_scale=torch.ones(5)),
        error=(ValueError, r"^x_scale: expected None"),
        dtypes=("float32",),
    ),
    _case(
        "errors/w4a8_group_size_not_dividing_k",
        lambda g, dt: mk(g, [2, 3], 32, 8, "w4a8") | {"group_size": 12},
        error=(ValueError, r"^group_size: expected a divisor"),
        dtypes=("w4a8",),
    ),
    _case(
        "errors/w8a8_missing_out_dtype",
        lambda g, dt: mk(g, [2, 3], 32, 8, "w8a8") | {"out_dtype": None},
        error=(ValueError, r"^out_dtype: expected a float dtype"),
        dtypes=("w8a8",),
    ),
]


def batch_subset(args: dict) -> Subset:
    """The second half of every expert's rows, run alone (token order inside an expert changes no row)."""
    offs = args["group_offsets"].tolist()
    keep = [r for e in range(len(offs) - 1) for r in range((offs[e] + offs[e + 1]) // 2, offs[e + 1])]
    if not keep or len(keep) == offs[-1]:
        return None
    idx = torch.tensor(keep)
    counts = [offs[e + 1] - (offs[e] + offs[e + 1]) // 2 for e in range(len(offs) - 1)]
    sub = dict(args, x=args["x"][idx], group_offsets=offsets(counts, args["group_offsets"].dtype))
    if args.get("x_scale") is not None:
        sub["x_scale"] = args["x_scale"][idx]
    return sub, lambda out: pick_rows(out, lambda t: t[idx])
