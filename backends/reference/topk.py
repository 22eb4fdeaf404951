"""Deterministic top-k (SPEC 2.3), the rule every backend must reproduce bitwise.

Order: value descending; equal values -> lower index first (-0.0 == +0.0); NaN below every number
(-inf included); non-candidates (columns >= lengths[r]) never selected: their slots get -1 / -inf.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS


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


IMPL = OpImpl(topk, OpCaps(FLOATS, tie_rule="lower_index", layout_invariant=True))
