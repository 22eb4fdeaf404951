"""Exact top-k selection by the rule of SPEC 2.3 (value descending, lower index first, -0.0 == +0.0,
NaN below every number, non-candidates never taken), built on `torch.topk` plus checks.

`torch.topk` is fast but does not order ties by index and ranks NaN above everything. Its selection is
still the rule's wherever the k-th and (k+1)-th values differ and no NaN is present, and its order is
wherever no two selected values are equal; only the rows where that fails take a slower exact path:
one sort of a composite (value, index) key (ties inside the selection), a scan for the lowest-index
values equal to the k-th (ties at the cut), or the rule's full sort (NaN, too few candidates).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
_LOW32 = (1 << 32) - 1


def rule_order(values: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Column permutation [R, C] sorting each row by the rule, non-candidates last. Among equal values
    the earlier column must carry the lower index (callers sort columns by index first)."""
    v = values.float() + 0.0  # one zero
    is_nan = torch.isnan(v)
    by_value = torch.sort(v.masked_fill(is_nan, NEG_INF), dim=-1, descending=True, stable=True).indices
    rank_class = is_nan.to(torch.int8) + 2 * (~candidate).to(torch.int8)  # number, NaN, non-candidate
    by_class = torch.sort(rank_class.gather(-1, by_value), dim=-1, stable=True).indices
    return by_value.gather(-1, by_class)


def order_key(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is the rule's order of (value, index) pairs (no NaN, idx < 2^32):
    the fp32 bits made monotone in the high word, the complemented index in the low word."""
    b = (values.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 and +0.0 get one key
    b = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: reverse their magnitude bits
    return (b.to(torch.int64) << 32) | (_LOW32 - idx.to(torch.int64))


def sort_pairs(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (value, index) pairs (no NaN) in the rule's order -> (values, indices int64)."""
    key, perm = torch.sort(order_key(vals, idx), dim=1, descending=True)
    return vals.gather(1, perm), _LOW32 - (key & _LOW32)


def _cut_ties(x, cand, v, col, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose k-th value thr (finite) is tied across the cut: the rule takes every value above thr
    (all in torch.topk's k+1) and then the lowest-index columns equal to thr. Returns (values, columns)."""
    n = x.shape[0]
    thr = v[:, k - 1]
    above = v > thr[:, None]  # [n, k+1]
    need = k - above.sum(dim=1)
    equal = x == thr[:, None].to(x.dtype)
    if cand is not None:
        equal &= cand
    r, c = torch.nonzero(equal, as_tuple=True)  # row-major: per row in column order
    start = torch.zeros(n + 1, dtype=torch.int64)
    start[1:] = torch.cumsum(torch.bincount(r, minlength=n), 0)
    rank = torch.arange(r.numel()) - start[r]
    keep_eq = rank < need[r]
    keep = torch.zeros(n, k + 1 + int(torch.bincount(r, minlength=n).max()), dtype=torch.bool)
    cols = torch.zeros(keep.shape, dtype=torch.int64)
    keep[:, : k + 1], cols[:, : k + 1] = above, col
    slot = k + 1 + rank
    keep[r, slot], cols[r, slot] = keep_eq, c
    sel = cols[keep].view(n, k)
    return sort_pairs(x.gather(1, sel), sel)


def topk_rows(
    x: torch.Tensor, k: int, cand: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rule top-k of each row of x [R, C] (0 < k < C) among candidate columns (cand [R, C] bool or None).
    Returns (values [R, k] dtype of x, columns int64 [R, k], taken bool [R, k] or None when every slot
    is taken); untaken slots are non-candidates (fewer than k in the row), their values -inf."""
    r = x.shape[0]
    xm = x if cand is None else x.masked_fill(~cand, NEG_INF)
    v, col = torch.topk(xm, k + 1, dim=1, sorted=True)  # descending, NaN first
    vals, cols = v[:, :k].contiguous(), col[:, :k].contiguous()
    taken = None
    nan_row = torch.isnan(v[:, 0])
    cut = v[:, k - 1] == v[:, k]
    inner = (v[:, 1:k] == v[:, : k - 1]).any(dim=1) & ~cut & ~nan_row
    if bool(inner.any()):
        rows = torch.nonzero(inner)[:, 0]
        vals[rows], cols[rows] = sort_pairs(vals[rows], cols[rows])
    cut &= ~nan_row
    finite = cut & torch.isfinite(v[:, k - 1])
    if bool(finite.any()):
        rows = torch.nonzero(finite)[:, 0]
        vals[rows], cols[rows] = _cut_ties(
            x[rows], None if cand is None else cand[rows], v[rows], col[rows], k
        )
    slow = nan_row | (cut & ~finite)
    if bool(slow.any()):
        rows = torch.nonzero(slow)[:, 0]
        cr = torch.ones_like(x[rows], dtype=torch.bool) if cand is None else cand[rows]
        order = rule_order(x[rows], cr)[:, :k]
        t = cr.gather(1, order)
        vals[rows] = torch.where(t, x[rows].gather(1, order), torch.tensor(NEG_INF, dtype=x.dtype))
        taken = torch.ones(r, k, dtype=torch.bool)
        cols[rows], taken[rows] = order, t
    return vals, cols, taken
