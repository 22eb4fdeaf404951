"""Conformance cases for `fp8_block_matmul` (SPEC 7.2): GLM-5 FP8 projection shapes, partial last K / N
blocks, K-block scales that differ by 2^20 (a kernel must promote per block), bias, UE8M0 activation
scales, strided operands. The dtype axis is `out_dtype`; comparator fp8_gemm (SPEC 7.2 tolerance).

Semantics: backends/reference/fp8_block_matmul.py (SPEC 7.2)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import Subset, randn, row_subset, strided, tdtype, transposed
from conformance.cases._fp8 import activations, weights

OUTPUTS = (Output("out", "fp8_gemm"),)


def _case(id: str, build, **kw) -> Case:
    return Case("fp8_block_matmul", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g, m, k, n, dt, *, bias=False, ue8m0=False):
    x_q, x_s = activations(g, m, k, ue8m0=ue8m0)
    w_q, w_s = weights(g, n, k)
    b = randn(g, n).to(tdtype(dt)) if bias else None
    return {"x_q": x_q, "x_scale": x_s, "w_q": w_q, "w_scale_inv": w_s, "bias": b, "out_dtype": tdtype(dt)}


def _scale_jumps(g, dt):
    a = mk(g, 4, 512, 256, dt)
    a["x_scale"][:, 1::2] *= 2.0**-20  # odd K blocks nearly vanish: one shared scale would be visible
    a["w_scale_inv"][1, :] *= 2.0**10
    return a


def _noncontig(g, dt):
    a = mk(g, 6, 384, 160, dt, bias=True)
    a["w_q"] = transposed(a["w_q"])
    a["x_q"] = strided(a["x_q"])
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 3, 256, 128, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case("smoke/m4_k256_n128", lambda g, dt: mk(g, 4, 256, 128, dt), tags={"shape": "M4 K256 N128"}),
    _case("smoke/m3_k300_n200_bias_partial", lambda g, dt: mk(g, 3, 300, 200, dt, bias=True)),
    _case(
        "realistic/q_a_proj_m16_k6144_n256_ue8m0",
        lambda g, dt: mk(g, 16, 6144, 256, dt, ue8m0=True),
        tags={"shape": "M16 K6144 N256"},
    ),
    _case(
        "realistic/o_proj_m32_k2048_n384",
        lambda g, dt: mk(g, 32, 2048, 384, dt),
        tags={"shape": "M32 K2048 N384"},
    ),
    _case("adversarial/k_block_scales_2p20_apart", _scale_jumps),
    _case("adversarial/k129_n7_m1", lambda g, dt: mk(g, 1, 129, 7, dt)),
    _case("adversarial/m70_k128_n130", lambda g, dt: mk(g, 70, 128, 130, dt)),
    _case("adversarial/noncontig_views", _noncontig, tags={"layout": "transposed w, strided x"}),
    _case("adversarial/empty_m0", lambda g, dt: mk(g, 0, 256, 128, dt), trivial=True),
    _case(
        "errors/x_q_bf16",
        _bad(x_q=lambda a: a["x_q"].bfloat16()),
        error=(ValueError, r"^x_q: expected dtype"),
    ),
    _case(
        "errors/w_q_int8",
        _bad(w_q=lambda a: a["w_q"].view(torch.int8)),
        error=(ValueError, r"^w_q: expected dtype"),
    ),
    _case(
        "errors/x_scale_per_token",
        _bad(x_scale=lambda a: a["x_scale"][:, 0]),
        error=(ValueError, r"^x_scale: expected shape"),
    ),
    _case(
        "errors/w_scale_inv_per_channel",
        _bad(w_scale_inv=lambda a: torch.ones(128)),
        error=(ValueError, r"^w_scale_inv: expected shape \[1, 2\]"),
    ),
    _case(
        "errors/k_mismatch",
        _bad(w_q=lambda a: a["w_q"][:, :128]),
        error=(ValueError, r"^w_q: expected shape"),
    ),
    _case(
        "errors/out_dtype_fp8",
        _bad(out_dtype=torch.float8_e4m3fn),
        error=(ValueError, r"^out_dtype: expected"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x_q", "x_scale"))
