"""cpu backend: topk (SPEC 2.3) as `torch.topk(k + 1)` plus the checks of `_select.topk_rows`.

Bitwise the reference's values and indices: the lower-index tie rule holds because rows where torch's
order could differ from the rule's (ties at the cut, NaN) take an exact path.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._select import rule_order, topk_rows


def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] float; lengths: [R] int32/int64 or None. Returns (values [R, k], indices int32 [R, k]).
    Semantics: backends/reference/topk.py (SPEC 2.3)
    """
    r, c = x.shape
    cand = None
    if lengths is not None:
        cand = torch.arange(c)[None, :] < lengths.to(torch.int64)[:, None]
    if k == 0 or r == 0:
        return x.new_full((r, k), float("-inf")), torch.full((r, k), -1, dtype=torch.int32)
    if k < c:
        vals, cols, taken = topk_rows(x, k, cand)
    else:  # every column is taken: a full sort by the rule, then padding
        cr = torch.ones(r, c, dtype=torch.bool) if cand is None else cand
        cols = rule_order(x, cr)
        taken = cr.gather(1, cols)
        vals = torch.where(taken, x.gather(1, cols), torch.tensor(float("-inf"), dtype=x.dtype))
        if k > c:
            cols = torch.cat([cols, cols.new_zeros(r, k - c)], dim=1)
            taken = torch.cat([taken, taken.new_zeros(r, k - c)], dim=1)
            vals = torch.cat([vals, vals.new_full((r, k - c), float("-inf"))], dim=1)
    idx = (cols if taken is None else torch.where(taken, cols, -1)).to(torch.int32)
    return vals, idx


IMPL = OpImpl(
    topk,
    OpCaps(
        FLOATS,
        notes={"ties": "rows tied across the k-th value or holding NaN take an exact per-row path"},
        run_to_run=True,
        batch_invariant=True,
        tie_rule="lower_index",
        layout_invariant=True,  # comparisons only
    ),
)
