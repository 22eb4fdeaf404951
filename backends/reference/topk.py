"""topk (SPEC 2.3): deterministic row-wise top-k (the MoE router's and the indexer's selection), the rule
every backend must reproduce bitwise. This module is the op's declaration too (`DECL`: the function below
is the signature; validators, fake, limits, sample).

Order: value descending; equal values -> lower index first (-0.0 == +0.0); NaN below every number
(-inf included); non-candidates (columns >= lengths[r]) never selected: their slots get -1 / -inf.
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_same_device, check_tensor, check_topk_width, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import FLOATS, dim, dtype_of, randn, scalar


def rule_order(values: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Column permutation [R, C] sorting each row by the rule, non-candidates last.

    Columns must be laid out so that, among equal keys, the earlier column has the lower index
    (true for plain columns and for `[sorted running top-k | later chunk]` merges).
    """
    v = values.float() + 0.0  # -0.0 + 0.0 == +0.0: one zero
    is_nan = torch.isnan(v)
    by_value = torch.sort(v.masked_fill(is_nan, float("-inf")), dim=-1, descending=True, stable=True).indices
    rank_class = is_nan.to(torch.int8) + 2 * (~candidate).to(torch.int8)  # 0 number, 1 NaN, 2 not a candidate
    by_class = torch.sort(rank_class.gather(-1, by_value), dim=-1, stable=True).indices
    return by_value.gather(-1, by_class)


@reference_op("topk")
def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] float, lengths int [R] or None -> (values [R, k] dtype of x, indices int32 [R, k])."""
    r, c = x.shape  # x: [R, C]
    cols = torch.arange(c)
    candidate = (
        (cols[None, :] < lengths.to(torch.int64)[:, None])
        if lengths is not None
        else torch.ones(r, c, dtype=torch.bool)
    )
    order = rule_order(x, candidate)[:, :k]  # [R, min(k, C)]
    taken = candidate.gather(-1, order)
    indices = torch.where(taken, order, -1).to(torch.int32)
    values = torch.where(taken, x.gather(-1, order), torch.tensor(float("-inf"), dtype=x.dtype))
    if k > c:  # fewer columns than k: pad
        indices = torch.cat([indices, indices.new_full((r, k - c), -1)], dim=1)
        values = torch.cat([values, values.new_full((r, k - c), float("-inf"))], dim=1)
    return values, indices


def check(x, k, lengths) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    check_topk_width("k", k, x.shape[1], "the columns of x")
    if lengths is not None:
        check_tensor("lengths", lengths, dtype=(torch.int32, torch.int64), shape=(x.shape[0],))
        check_same_device(x=x, lengths=lengths)


def values(x, k, lengths) -> None:
    if lengths is not None and lengths.numel():
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > x.shape[1]:
            fail("lengths", f"values in [0, {x.shape[1]}] (columns of x)", f"range [{lo}, {hi}]")


def unchecked(args: dict) -> tuple[dict, None]:
    """lengths clamped to [0, C]: a negative length has no candidates, one past C has all of them."""
    lengths = args["lengths"]
    if lengths is None:
        return args, None
    return {**args, "lengths": lengths.clamp(0, args["x"].shape[1])}, None


def fake(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, k = a["x"], a["k"]
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(x=randn(g, 5, 3000, dtype=dt), k=64, lengths=torch.tensor([3000, 10, 0, 2999, 64]))


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with `quantity` ("k" or "columns") at v."""
    cols = v if quantity == "columns" else max(v + 7, 64)
    k = v if quantity == "k" else min(8, cols)
    return dict(x=randn(g, 3, cols, dtype=dt if dt in FLOATS else "float32"), k=k, lengths=None)


DECL = OpDecl(
    name="topk",
    spec_section="2.3",
    signature=topk,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=check,
    values=values,
    unchecked=unchecked,
    fake=fake,
    sample=sample,
    sized=sized,
    sharding="replicated",
    quantities={"k": scalar("k"), "columns": dim("x", 1)},
)
IMPL = OpImpl(topk, OpCaps(FLOATS, tie_rule="lower_index", layout_invariant=True))
