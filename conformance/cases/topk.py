"""Conformance cases for `topk` (SPEC 2.3): MoE-router and indexer-row shapes, exact ties, near-ties in
the low mantissa bits, NaN/-inf/signed zeros, candidate lengths at every boundary, k > columns.

Semantics: backends/reference/topk.py (SPEC 2.3)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import (
    Subset,
    near_ties,
    randint,
    randn,
    row_subset,
    strided,
    tdtype,
    transposed,
)

OUTPUTS = (Output("values", "topk_values"), Output("indices", "topk_indices"))


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("topk", id, build, **kw)
    return Case("topk", id, build, OUTPUTS, **kw)


def _x(g, r, c, dt, scale=1.0):
    return randn(g, r, c, scale=scale).to(tdtype(dt))


def _plateau(g, dt):
    # ReLU output: a few positive scores per row, the rest exactly 0 (more zeros than k)
    x = torch.relu(randn(g, 6, 64)) * (torch.rand(6, 64, generator=g) < 0.15)
    x[3] = 0.0
    return {
        "x": x.to(tdtype(dt)),
        "k": 16,
        "lengths": torch.tensor([64, 64, 40, 64, 17, 3], dtype=torch.int32),
    }


def _signed_zero(g, dt):
    x = torch.zeros(4, 24)
    x[:, 1::3] = -0.0
    x[1, 5] = 1.0
    x[2, 7] = -1.0
    return {"x": x.to(tdtype(dt)), "k": 9}


def _nan_inf(g, dt):
    x = randn(g, 5, 32)
    x[0, ::3] = float("nan")
    x[1, 4:20] = float("-inf")
    x[2] = float("nan")
    x[3, ::2] = float("inf")
    x[4, :30] = float("-inf")
    x[4, 30:] = float("nan")
    return {"x": x.to(tdtype(dt)), "k": 12, "lengths": torch.tensor([32, 30, 32, 17, 32])}


def _boundaries(g, dt):
    k, c = 32, 100
    return {
        "x": near_ties(g, (8, c), dt),
        "k": k,
        "lengths": torch.tensor([0, 1, k - 1, k, k + 1, c - 1, c, 2], dtype=torch.int32),
    }


def _dup_columns(g, dt):
    x = _x(g, 3, 40, dt)
    x[:, ::5] = x[:, 0:1]  # exact duplicates of the first column
    return {"x": x, "k": 40}


def _indexer_rows(g, dt):
    s, k = 4500, 2048
    x = near_ties(g, (8, s), dt)
    x[:, ::7] = torch.relu(randn(g, 8, (s + 6) // 7)).to(x.dtype)
    return {
        "x": x,
        "k": k,
        "lengths": torch.tensor([4500, 4499, 2048, 2047, 2049, 3001, 1, 0], dtype=torch.int32),
    }


def _router(g, dt):
    # sigmoid scores + correction bias, as the GLM-5 router chooses experts (E=256, top-8)
    x = torch.sigmoid(randn(g, 64, 256)) + randn(g, 256, scale=0.01)
    return {"x": x.to(tdtype(dt)), "k": 8}


CASES = [
    _case(
        "smoke/random_r4_c16_k5", lambda g, dt: {"x": _x(g, 4, 16, dt), "k": 5}, tags={"shape": "R4 C16 k5"}
    ),
    _case(
        "smoke/lengths_r5_c12_k8",
        lambda g, dt: {
            "x": _x(g, 5, 12, dt),
            "k": 8,
            "lengths": torch.tensor([0, 1, 7, 8, 12], dtype=torch.int32),
        },
    ),
    _case("realistic/moe_router_t64_e256_k8", _router, tags={"shape": "R64 C256 k8"}),
    _case("realistic/indexer_rows_r8_s4500_k2048", _indexer_rows, tags={"shape": "R8 C4500 k2048"}),
    _case(
        "adversarial/ties_constant_rows",
        lambda g, dt: {"x": torch.full((4, 24), 0.75, dtype=tdtype(dt)), "k": 7},
    ),
    _case("adversarial/ties_relu_plateau", _plateau, tags={"shape": "R6 C64 k16"}),
    _case("adversarial/ties_duplicate_columns_k_eq_c", _dup_columns),
    _case(
        "adversarial/near_ties_low_bits_r16_c300_k64",
        lambda g, dt: {"x": near_ties(g, (16, 300), dt), "k": 64},
    ),
    _case("adversarial/signed_zero_ties", _signed_zero),
    _case("adversarial/nan_inf", _nan_inf),
    _case("adversarial/lengths_boundaries_k32", _boundaries),
    _case("adversarial/k_gt_columns", lambda g, dt: {"x": _x(g, 3, 9, dt), "k": 20}),
    _case(
        "adversarial/k1_int64_lengths",
        lambda g, dt: {"x": near_ties(g, (5, 50), dt), "k": 1, "lengths": randint(g, 0, 50, 5)},
    ),
    _case(
        "adversarial/noncontig_transposed",
        lambda g, dt: {"x": transposed(near_ties(g, (12, 40), dt)), "k": 10},
        tags={"layout": "transposed"},
    ),
    _case(
        "adversarial/noncontig_strided",
        lambda g, dt: {"x": strided(_x(g, 6, 30, dt)), "k": 6, "lengths": torch.tensor([30, 0, 5, 6, 7, 29])},
        tags={"layout": "strided"},
    ),
    _case(
        "adversarial/empty_rows_r0",
        lambda g, dt: {"x": torch.empty(0, 10, dtype=tdtype(dt)), "k": 3},
        trivial=True,
    ),
    _case(
        "errors/x_int_dtype",
        lambda g, dt: {"x": torch.zeros(2, 4, dtype=torch.int32), "k": 1},
        error=(ValueError, r"^x: expected dtype"),
        dtypes=("float32",),
    ),
    _case(
        "errors/x_1d",
        lambda g, dt: {"x": _x(g, 1, 8, dt)[0], "k": 1},
        error=(ValueError, r"^x: expected 2 dims"),
    ),
    _case(
        "errors/k_zero",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 0},
        error=(ValueError, r"^k: expected an int >= 1"),
    ),
    _case(
        "errors/k_past_padding_limit",  # only -1 / -inf padding past C: refused before allocating
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2**40},
        error=(ValueError, r"^k: expected an int in \[1, max\(8, 65536\)\]"),
    ),
    _case(
        "errors/k_float",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2.0},
        error=(ValueError, r"^k: expected an int"),
    ),
    _case(
        "errors/lengths_above_columns",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2, "lengths": torch.tensor([8, 9])},
        error=(ValueError, r"^lengths: expected values in \[0, 8\]"),
    ),
    _case(
        "errors/lengths_negative",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2, "lengths": torch.tensor([-1, 3])},
        error=(ValueError, r"^lengths: expected values in"),
    ),
    _case(
        "errors/lengths_wrong_shape",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2, "lengths": torch.tensor([3])},
        error=(ValueError, r"^lengths: expected shape \[2\]"),
    ),
    _case(
        "errors/lengths_other_device",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2, "lengths": torch.tensor([3, 1], device="meta")},
        error=(ValueError, r"^lengths: expected device"),
    ),
    _case(
        "errors/lengths_float",
        lambda g, dt: {"x": _x(g, 2, 8, dt), "k": 2, "lengths": torch.tensor([3.0, 1.0])},
        error=(ValueError, r"^lengths: expected dtype"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return row_subset(args, ("x", "lengths"))
