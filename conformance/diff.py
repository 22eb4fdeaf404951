"""Cross-backend diff (`glm5 conformance --backend A --backend B --diff`): where two backends disagree with
each other, not only with the reference, on the same inputs.

Every selected case (errors/ cases excepted) builds its seeded CPU inputs once; each backend gets its own
copy on its device. Cases either backend declines, or its expectations manifest skips, are listed but not
compared. For a case both backends serve, each output is compared A against B:

    identical   bitwise equal (NaNs in the same places)
    close       floats within the case's comparator tolerance, taking B as the expected side
    differs     anything else: integer outputs that differ, or floats beyond the tolerance

For top-k outputs (topk, indexer_topk) a difference is described per row as the positions only A selected
and only B selected, with their scores (the input values for topk, the reference's indexer logits for
indexer_topk) and the gap between them: which keys two chips swap at near-ties.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from backends.errors import NotSupported
from backends.interface import Backend
from conformance.case import Case, args_to, clone_args, host_outputs
from conformance.comparators import COMPARATORS, compare
from conformance.compare import Context
from conformance.result import describe

TOPK_OPS = ("topk", "indexer_topk")
#: rows of a top-k difference described per case
ROWS_SHOWN = 3
#: positions per side shown in a row's text (the JSON keeps them all)
POSITIONS_SHOWN = 4


@dataclass
class OutputDiff:
    output: str
    verdict: str  # identical | close | differs
    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    swaps: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CaseDiff:
    op: str
    dtype: str
    case: str
    status: str  # identical | close | differs | declined | skipped | error
    message: str = ""
    outputs: list[OutputDiff] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "dtype": self.dtype,
            "case": self.case,
            "status": self.status,
            "message": self.message,
            "outputs": [vars(o) for o in self.outputs],
        }


def _run(be: Backend, case: Case, args: dict[str, Any]) -> tuple[tuple | None, str]:
    try:
        return host_outputs(getattr(be, case.op)(**args_to(clone_args(args), be.device))), ""
    except NotSupported as exc:
        return None, f"{be.name} declined: {'; '.join(exc.reasons)}"
    except Exception as exc:
        return None, f"{be.name} raised {describe(exc)}"


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return bool(
            torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        )
    return bool(torch.equal(a, b))


def _scores(case: Case, args: dict[str, Any], reference: Backend) -> torch.Tensor:
    """What a top-k output's positions are ranked by: x (topk), the reference's logits (indexer_topk)."""
    if case.op == "topk":
        return args["x"].float()
    a = {k: v for k, v in clone_args(args).items() if k != "topk"}
    return reference.indexer_logits(**a).float()


def _swaps(ia: torch.Tensor, ib: torch.Tensor, scores: torch.Tensor) -> list[dict[str, Any]]:
    out = []
    for r in range(ia.shape[0]):
        a, b = ia[r].tolist(), ib[r].tolist()
        if a == b:
            continue
        only_a = sorted(set(a) - set(b) - {-1})
        only_b = sorted(set(b) - set(a) - {-1})
        row: dict[str, Any] = {"row": r}
        if not only_a and not only_b:
            row["kind"] = "same positions, different order"
        else:
            row["kind"] = "different positions"
            sa = {p: float(scores[r, p]) for p in only_a}
            sb = {p: float(scores[r, p]) for p in only_b}
            row["only_a"], row["only_b"] = sa, sb
            vals = list(sa.values()) + list(sb.values())
            if vals:
                top = max(abs(v) for v in vals) or 1.0
                row["score_gap"] = max(vals) - min(vals)
                row["relative_gap"] = row["score_gap"] / top
        out.append(row)
    return out


def _compare_output(case: Case, dtype: str, i: int, a: Any, b: Any, args, reference) -> OutputDiff:
    spec = case.outputs[i] if i < len(case.outputs) else None
    name = spec.name if spec else f"output{i}"
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        same = a == b
        return OutputDiff(name, "identical" if same else "differs", "" if same else f"{a!r} vs {b!r}")
    if a.shape != b.shape or a.dtype != b.dtype:
        return OutputDiff(name, "differs", f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    if _identical(a, b):
        return OutputDiff(name, "identical")
    if not a.dtype.is_floating_point:
        n = int((a != b).sum())
        if case.op in TOPK_OPS and name == "indices":
            swaps = _swaps(a, b, _scores(case, args, reference))
            kinds = Counter(s["kind"] for s in swaps)
            detail = (
                f"{len(swaps)} of {a.shape[0]} rows differ ("
                + ", ".join(f"{v} {k}" for k, v in kinds.items())
                + ")"
            )
            return OutputDiff(name, "differs", detail, {"rows": len(swaps)}, swaps)
        big = int((a.long() - b.long()).abs().max())
        return OutputDiff(
            name, "differs", f"{n} elements differ, by up to {big}", {"elements": n, "max_abs": big}
        )
    fa, fb = a.double(), b.double()
    both = torch.isfinite(fa) & torch.isfinite(fb)
    err = (fa - fb).abs().where(both, torch.zeros((), dtype=torch.float64))
    rel = (err / fb.abs().clamp_min(1e-30)).where(both, torch.zeros((), dtype=torch.float64))
    metrics = {
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
        "elements": int((~(fa == fb) & ~(torch.isnan(fa) & torch.isnan(fb))).sum()),
        "nonfinite_mismatch": int((torch.isfinite(fa) != torch.isfinite(fb)).sum()),
    }
    detail = (
        f"{metrics['elements']} elements differ; "
        f"max abs {metrics['max_abs']:.3g}, max rel {metrics['max_rel']:.3g}"
    )
    if spec is not None and spec.comparator in COMPARATORS:
        ctx = Context(case.op, dtype, args, reference=reference)
        ok = compare(name, spec.comparator, a, b, ctx, dict(spec.params)).ok
        return OutputDiff(name, "close" if ok else "differs", detail, metrics)
    return OutputDiff(name, "differs", detail, metrics)


def _skips(be: Backend):
    """case key -> the backend's manifest skip reason (a skipped case is not run there, nor compared)."""
    from conformance.manifest import load

    manifest = load(be.expectations_path())
    env = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in be.environment().items()}

    def skip(key: str) -> str | None:
        e = manifest.expectation(key, env)
        return e.reason if e is not None and e.status == "skip" else None

    return skip


def diff_case(
    a: Backend, b: Backend, reference: Backend, case: Case, dtype: str, skips=(lambda k: None,) * 2
) -> CaseDiff:
    res = CaseDiff(case.op, dtype, case.id, "identical")
    why = [f"{be.name} manifest skips it: {r}" for be, s in zip((a, b), skips) if (r := s(case.key(dtype)))]
    why += [f"{be.name} borrows {case.op} from the reference" for be in (a, b) if case.op in be.borrowed]
    if why:
        res.status, res.message = "skipped", "; ".join(why)
        return res
    try:
        args = case.inputs(dtype)
    except Exception as exc:
        res.status, res.message = "error", f"input builder raised {describe(exc)}"
        return res
    out_a, why_a = _run(a, case, args)
    out_b, why_b = _run(b, case, args)
    if out_a is None or out_b is None:
        res.status, res.message = "declined", "; ".join(w for w in (why_a, why_b) if w)
        return res
    if len(out_a) != len(out_b):
        res.status, res.message = "differs", f"{len(out_a)} outputs vs {len(out_b)}"
        return res
    try:
        res.outputs = [
            _compare_output(case, dtype, i, x, y, args, reference)
            for i, (x, y) in enumerate(zip(out_a, out_b))
        ]
    except Exception as exc:
        res.status, res.message = "error", f"comparison raised {describe(exc)}"
        return res
    verdicts = {o.verdict for o in res.outputs}
    res.status = "differs" if "differs" in verdicts else "close" if "close" in verdicts else "identical"
    res.message = "; ".join(f"{o.output}: {o.detail}" for o in res.outputs if o.verdict != "identical")
    return res


def run(
    a: Backend, b: Backend, selection: Sequence[tuple[Case, str]], reference: Backend | None = None
) -> list[CaseDiff]:
    import backends

    reference = reference or backends.get("reference")
    skips = (_skips(a), _skips(b))
    return [diff_case(a, b, reference, c, dt, skips) for c, dt in selection if c.suite != "errors"]


def summary(diffs: Sequence[CaseDiff]) -> dict[str, dict[str, int]]:
    """op -> status -> count."""
    out: dict[str, Counter] = {}
    for d in diffs:
        out.setdefault(d.op, Counter())[d.status] += 1
    return {op: dict(sorted(c.items())) for op, c in out.items()}


def to_json(a: str, b: str, diffs: Sequence[CaseDiff]) -> dict[str, Any]:
    return {"backends": [a, b], "summary": summary(diffs), "cases": [d.to_json() for d in diffs]}


def swap_text(s: dict[str, Any], a: str, b: str) -> str:
    if s["kind"] != "different positions":
        return f"row {s['row']}: {s['kind']}"

    def fmt(d: dict[int, float]) -> str:
        shown = ", ".join(f"{p} ({v:.9g})" for p, v in list(d.items())[:POSITIONS_SHOWN]) or "-"
        return shown + (f" (+{len(d) - POSITIONS_SHOWN} more)" if len(d) > POSITIONS_SHOWN else "")

    gap = f"; score gap {s['score_gap']:.3g} (relative {s['relative_gap']:.2g})" if "score_gap" in s else ""
    return f"row {s['row']}: only {a} {fmt(s['only_a'])}; only {b} {fmt(s['only_b'])}{gap}"


def render(a: str, b: str, diffs: Sequence[CaseDiff], console) -> None:
    from rich.markup import escape

    for d in diffs:
        if d.status not in ("differs", "error"):
            continue
        console.print(f"[red]{d.status.upper()}[/] {a} vs {b} {d.op}/{d.dtype}/{d.case}: {escape(d.message)}")
        for o in d.outputs:
            for s in o.swaps[:ROWS_SHOWN]:
                console.print(f"    {escape(swap_text(s, a, b))}")
            if len(o.swaps) > ROWS_SHOWN:
                console.print(f"    ... {len(o.swaps) - ROWS_SHOWN} more rows")
    for op, c in summary(diffs).items():
        console.print(f"diff {a} vs {b} {op}: " + ", ".join(f"{k} {v}" for k, v in c.items()))


def exit_code(diffs: Sequence[CaseDiff]) -> int:
    """1 when the backends disagree beyond tolerance (or a comparison failed), or nothing was compared."""
    compared = [d for d in diffs if d.status not in ("declined", "skipped")]
    if not compared:
        return 1
    return 1 if any(d.status in ("differs", "error") for d in diffs) else 0


def main(names, ops, suite, case_glob, dtypes, json_path, console) -> int:
    """`glm5 conformance --diff`: exactly two backends; exit 2 on bad input, else `exit_code`."""
    import json
    import sys

    import backends
    from backends.errors import BackendUnavailable
    from conformance import cases

    if len(names) != 2:
        print(
            f"error: --diff: expected exactly two --backend names, got {len(names)} ({', '.join(names)})",
            file=sys.stderr,
        )
        return 2
    try:
        a, b = (backends.get(n) for n in names)
        selection = cases.select(ops, suite, case_glob, dtypes)
    except (BackendUnavailable, ValueError) as exc:
        print(f"error: {(str(exc).splitlines() or [type(exc).__name__])[0]}", file=sys.stderr)
        return 2
    diffs = run(a, b, selection)
    render(a.name, b.name, diffs, console)
    if json_path:
        from conformance.report import write_text_report

        write_text_report(json_path, json.dumps(to_json(a.name, b.name, diffs), indent=1, default=str))
    return exit_code(diffs)
