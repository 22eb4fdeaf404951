"""Exact top-k selection by the rule of SPEC 2.3 (value descending, lower index first, -0.0 == +0.0,
NaN below every number, non-candidates never taken), built on `torch.topk` plus checks.

`torch.topk` is fast but does not order ties by index and ranks NaN above everything. Its selection is
still the rule's wherever the k-th and (k+1)-th values differ and no NaN is present; only the rows where
that fails take a slower exact path: a threshold pass (one scan of the row, for ties at the cut) or the
full rule sort (NaN rows, rows with too few candidates).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def rule_order(values: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Column permutation [R, C] sorting each row by the rule, non-candidates last. Among equal values
    the earlier column must carry the lower index (callers sort columns by index first)."""
    v = values.float() + 0.0  # one zero
    is_nan = torch.isnan(v)
    by_value = torch.sort(v.masked_fill(is_nan, NEG_INF), dim=-1, descending=True, stable=True).indices
    rank_class = is_nan.to(torch.int8) + 2 * (~candidate).to(torch.int8)  # number, NaN, non-candidate
    by_class = torch.sort(rank_class.gather(-1, by_value), dim=-1, stable=True).indices
    return by_value.gather(-1, by_class)


def order_numbers(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order rows of (value, index) pairs, no NaN, by the rule: a plain descending sort, then rows that
    hold equal values re-sorted by index and stably by value (ties are rare in fp32 scores)."""
    sv, o = torch.sort(vals, dim=1, descending=True)
    si = idx.gather(1, o)
    if vals.shape[1] > 1:
        tied = (sv[:, 1:] == sv[:, :-1]).any(dim=1)
        if bool(tied.any()):
            rows = torch.nonzero(tied)[:, 0]
            ti, oi = torch.sort(idx[rows], dim=1)
            tv = vals[rows].gather(1, oi)
            tv, os_ = torch.sort(tv, dim=1, descending=True, stable=True)
            sv[rows], si[rows] = tv, ti.gather(1, os_)
    return sv, si


def _threshold_rows(x: torch.Tensor, cand: torch.Tensor | None, thr: torch.Tensor, k: int) -> torch.Tensor:
    """Column indices [n, k], ascending, of the rule's top-k of rows whose k-th value `thr` is a finite
    number tied across the cut: every candidate above thr, then the lowest-index ones equal to it."""
    xt = x.float()
    above, equal = xt > thr[:, None], xt == thr[:, None]
    if cand is not None:
        above &= cand
        equal &= cand
    need = k - above.sum(dim=1)
    equal &= torch.cumsum(equal, dim=1, dtype=torch.int32) <= need[:, None]
    return torch.nonzero(above | equal)[:, 1].view(x.shape[0], k)


def topk_rows(
    x: torch.Tensor, k: int, cand: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rule top-k of each row of x [R, C] (k < C) among candidate columns (cand [R, C] bool or None).
    Returns (values [R, k] dtype of x, columns int64 [R, k], taken bool [R, k]); untaken slots are
    non-candidates (fewer than k in the row), their values -inf."""
    r = x.shape[0]
    xm = x if cand is None else x.masked_fill(~cand, NEG_INF)
    v, col = torch.topk(xm, k + 1, dim=1, sorted=False)
    nan_row = torch.isnan(v).any(dim=1)  # torch.topk ranks NaN first: a NaN anywhere is in v
    vm = v.masked_fill(nan_row[:, None], 0)
    low = vm.amin(dim=1)
    tie = (vm == low[:, None]).sum(dim=1) > 1  # the k-th value equals the (k+1)-th
    drop = vm.argmin(dim=1, keepdim=True)  # the unique (k+1)-th where there is no tie
    col = col.scatter(1, drop, col[:, k:])[:, :k]
    v = v.scatter(1, drop, v[:, k:])[:, :k]
    vals, cols = order_numbers(v, col)
    taken = torch.ones(r, k, dtype=torch.bool)
    slow = nan_row | tie
    if bool(slow.any()):
        thr = torch.where(nan_row | ~tie, 0, low)
        finite_tie = tie & ~nan_row & torch.isfinite(thr)
        rows = torch.nonzero(finite_tie)[:, 0]
        if rows.numel():
            c = _threshold_rows(x[rows], None if cand is None else cand[rows], thr[rows], k)
            ov, oc = torch.sort(x[rows].gather(1, c), dim=1, descending=True, stable=True)
            vals[rows], cols[rows] = ov, c.gather(1, oc)
        rows = torch.nonzero(slow & ~finite_tie)[:, 0]
        if rows.numel():
            cr = torch.ones_like(x[rows], dtype=torch.bool) if cand is None else cand[rows]
            order = rule_order(x[rows], cr)[:, :k]
            t = cr.gather(1, order)
            vals[rows] = torch.where(t, x[rows].gather(1, order), torch.tensor(NEG_INF, dtype=x.dtype))
            cols[rows], taken[rows] = order, t
    return vals, cols, taken
