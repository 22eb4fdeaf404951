"""Top-k comparators (SPEC 2.3, 4): which contract depends on the backend's declared tie rule.

tie_rule "lower_index" (or the reference itself): indices bitwise equal to the reference's.
tie_rule "none": the weaker exact contract (vLLM's `_assert_exact_topk`): -1 padding in the same
slots, no duplicate index in a row, every index a candidate, and the multiset of selected values
exactly the reference's. Values of `topk` are then compared as numbers (-0.0 == +0.0).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.reference._cache import gather_rows
from conformance.compare import WORST, Check, Context, close, exact


def _rowwise_multiset_equal(va: torch.Tensor, vr: torch.Tensor) -> torch.Tensor:
    """[R] bool: the rows of va and vr hold the same multiset of numbers (NaN == NaN, -0 == +0)."""
    sa, sr = torch.sort(va + 0.0, dim=1).values, torch.sort(vr + 0.0, dim=1).values
    same = (sa == sr) | (torch.isnan(sa) & torch.isnan(sr))
    return same.all(dim=1)


def _weak(
    name: str, idx_a: torch.Tensor, idx_r: torch.Tensor, values: torch.Tensor, limit: torch.Tensor
) -> Check:
    """idx_*: int [R, k]; values: [R, C] float64 scores the indices select; limit: [R] candidate count."""
    r, k = idx_r.shape
    ia = idx_a.to(torch.int64)
    ir = idx_r.to(torch.int64)
    va_ok, vr_ok = ia >= 0, ir >= 0
    problems: list[tuple[str, torch.Tensor]] = []
    problems.append(("-1 padding in other slots than the reference", (va_ok != vr_ok).any(dim=1)))
    problems.append(
        (
            "index out of the candidate range",
            (va_ok & (ia >= limit[:, None])).any(dim=1) | ((ia < -1).any(dim=1)),
        )
    )
    s = torch.sort(torch.where(va_ok, ia, -1 - torch.arange(k)[None, :]), dim=1).values
    problems.append(
        ("duplicate index", (s[:, 1:] == s[:, :-1]).any(dim=1) if k > 1 else torch.zeros(r, dtype=bool))
    )
    safe_a = ia.clamp(0, max(values.shape[1] - 1, 0))
    safe_r = ir.clamp(0, max(values.shape[1] - 1, 0))
    if values.shape[1]:
        ga = torch.where(va_ok, values.gather(1, safe_a), float("-inf"))
        gr = torch.where(vr_ok, values.gather(1, safe_r), float("-inf"))
        problems.append(("selected values differ from the reference's", ~_rowwise_multiset_equal(ga, gr)))
    bad_rows = torch.zeros(r, dtype=torch.bool)
    msgs, worst = [], []
    for what, rows in problems:
        rows = rows & ~bad_rows
        if rows.any():
            ids = torch.nonzero(rows)[:, 0]
            msgs.append(f"{what} in {len(ids)} row(s)")
            for row in ids[:WORST].tolist():
                worst.append(
                    {
                        "index": [row],
                        "actual": ia[row].tolist()[:16],
                        "expected": ir[row].tolist()[:16],
                        "allowed": f"tie_rule none: {what} not allowed",
                    }
                )
            bad_rows |= rows
    n = int(bad_rows.sum())
    msg = f"{name} (weak contract, tie_rule none): " + "; ".join(msgs) if n else ""
    return Check(name, n == 0, msg, {"mismatches": n, "rows": r, "contract": "tie_rule none"}, worst)


def _strict(ctx: Context) -> bool:
    return ctx.tie_rule in (None, "lower_index")


def topk_values(name: str, a: Any, r: torch.Tensor, ctx: Context, **_: float) -> Check:
    if _strict(ctx):
        return exact(name, a, r, ctx)
    return close(name, a, r, ctx, rtol=0.0, atol=0.0)


def topk_indices(name: str, a: Any, r: torch.Tensor, ctx: Context, **_: float) -> Check:
    if _strict(ctx) or not isinstance(a, torch.Tensor) or a.shape != r.shape or a.dtype != r.dtype:
        return exact(name, a, r, ctx)
    x = ctx.args["x"].double()
    lengths = ctx.args.get("lengths")
    limit = torch.full((x.shape[0],), x.shape[1]) if lengths is None else lengths.to(torch.int64)
    return _weak(name, a.detach().cpu(), r, x, limit)


def _structural_tie(args: dict[str, Any], t: int, i: int, j: int, logit: float) -> bool:
    """Keys i and j of token t's request tie in every summation order: both scores are exactly zero
    (the ReLU plateau) or the two keys are the same vector."""
    if logit == 0.0:
        return True
    layout = args["layout"]
    for b, (q0, q1, _) in enumerate(layout.request_bounds()):
        if q0 <= t < q1:
            rows = gather_rows(args["k_cache"], layout, b, torch.tensor([i, j]))
            return bool(torch.equal(rows[0], rows[1]))
    return False


def _near_ties(
    name: str,
    ia: torch.Tensor,
    ir: torch.Tensor,
    logits: torch.Tensor,
    args: dict[str, Any],
    rtol: float,
    atol: float,
) -> Check:
    """Strict rule with a declared near-tie tolerance (a manifest override with a reason): at every rank
    the backend's index equals the reference's, or the two keys' reference logits lie within
    atol + rtol * |logit| (a backend summing in another order may swap them). Structural ties (zero
    scores, identical keys) tie in every order, so they must still come out lower index first; -1
    padding must sit in the same slots."""
    ia, ir = ia.to(torch.int64), ir.to(torch.int64)
    la = logits.gather(1, ia.clamp(min=0))
    lr = logits.gather(1, ir.clamp(min=0))
    differ = ia != ir
    swap_ok = differ & (ia >= 0) & (ir >= 0) & ((la - lr).abs() <= atol + rtol * lr.abs())
    for t, c in torch.nonzero(swap_ok & (la == lr)).tolist():
        if _structural_tie(args, t, int(ia[t, c]), int(ir[t, c]), float(lr[t, c])):
            swap_ok[t, c] = False
    bad = differ & ~swap_ok
    metrics = {
        "mismatches": int(bad.sum()),
        "near_tie_swaps": int(swap_ok.sum()),
        "near_tie_rtol": rtol,
        "near_tie_atol": atol,
    }
    if not bad.any():
        return Check(name, True, "", metrics)
    worst = [
        {
            "index": [row, col],
            "actual": int(ia[row, col]),
            "expected": int(ir[row, col]),
            "allowed": f"same index, or a key whose reference logit lies within {atol:g} + {rtol:g}*|logit| "
            f"and is no structural tie (logits {float(la[row, col]):.9g} vs {float(lr[row, col]):.9g})",
        }
        for row, col in torch.nonzero(bad)[:WORST].tolist()
    ]
    msg = f"{name}: {int(bad.sum())} index(es) differ beyond the declared near-tie tolerance"
    return Check(name, False, msg, metrics, worst)


def indexer_topk_indices(name: str, a: Any, r: torch.Tensor, ctx: Context, **params: float) -> Check:
    rtol, atol = params.get("near_tie_rtol", 0.0), params.get("near_tie_atol", 0.0)
    well_formed = isinstance(a, torch.Tensor) and a.shape == r.shape and a.dtype == r.dtype
    if _strict(ctx) and (not (rtol or atol) or not well_formed):
        return exact(name, a, r, ctx)
    args = ctx.args
    logits = ctx.reference.indexer_logits(args["q"], args["k_cache"], args["weights"], args["layout"])
    if _strict(ctx):
        if logits.shape[1] == 0:
            return exact(name, a, r, ctx)
        return _near_ties(name, a.detach().cpu(), r, logits.double(), args, rtol, atol)
    if not well_formed:
        return exact(name, a, r, ctx)
    limit = torch.zeros(logits.shape[0], dtype=torch.int64)
    for q0, q1, s in args["layout"].request_bounds():
        i = torch.arange(q1 - q0)
        limit[q0:q1] = (s - (q1 - q0) + i + 1).clamp(0, s)
    return _weak(name, a.detach().cpu(), r, logits.double(), limit)


COMPARATORS = {
    "topk_values": topk_values,
    "topk_indices": topk_indices,
    "indexer_topk_indices": indexer_topk_indices,
}
