"""`glm5 port status NAME`: the porting report of a backend, built on one conformance run (the runner and
report of `glm5 conformance`, so every number matches its JSON) plus the model-level checks and the ops
GLM-5 needs for a config and recipe (glm5/port/needs.py).

A row is one op x dtype of the fixed matrix (backends.contract.ops.OPS). Its state counts the numeric cases
(smoke, realistic, adversarial, limits); `errors/` cases check argument validation, which is shared code of
`backends.Backend`, so they pass even for a backend that serves nothing and are counted apart:

    passing      every numeric case ran and passed
    partial      some passed; the others were declined (limits, layouts), skipped or expected failures
    failing      a case failed (FAIL, ERROR or XPASS; validation cases included), or every numeric case
                 that ran is a manifest's expected failure
    borrowed     the backend borrows the op (backends/borrow.py): the reference serves it on host copies;
                 its cost (calls, bytes, seconds) is measured over the model-level checks
    unsupported  no numeric case ran: every one was declined (or some skipped), with the reasons given
    skipped      every numeric case was skipped by the backend's manifest (with its reason)
    not run      the suite selected no case of the row
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.contract.ops import OPS
from conformance.report import BackendRun, cell, summary
from conformance.result import BORROWED, FAILING, PASS, RAN, SKIPPED, Result

STATES = ("passing", "partial", "failing", "borrowed", "unsupported", "skipped", "not run")


@dataclass(frozen=True)
class Need:
    """What the user wants to run: a config (preset or config.json), quantization recipes, dtype, training."""

    config: str = "tiny"
    recipes: tuple[str, ...] = ()
    dtype: str | None = None
    train: bool = False


def _reasons(rs: Sequence[Result], limit: int = 3) -> list[str]:
    c = Counter(r.message for r in rs)
    return [f"{msg} (x{n})" if n > 1 else msg for msg, n in c.most_common(limit)]


def row(op: str, dtype: str, results: Sequence[Result]) -> dict[str, Any]:
    numeric = [r for r in results if not r.case.startswith("errors/")]
    validation = [r for r in results if r.case.startswith("errors/")]
    counts = Counter(r.status for r in results)
    failing = [r for r in results if r.status in FAILING]
    ran = [r for r in numeric if r.status in RAN]
    passed = [r for r in numeric if r.status == PASS]
    if not results:
        state = "not run"
    elif failing:
        state = "failing"
    elif numeric and all(r.status == BORROWED for r in numeric):
        state = "borrowed"
    elif not ran:
        state = "skipped" if all(r.status == SKIPPED for r in numeric) else "unsupported"
    elif len(passed) == len(numeric):
        state = "passing"
    elif passed:
        state = "partial"
    else:
        state = "failing"  # ran, none passed, nothing failing: only expected failures
    others = [r for r in numeric if r.status != PASS]
    return {
        "op": op,
        "dtype": dtype,
        "state": state,
        "cell": cell(results),  # the conformance matrix's cell of this row, verbatim
        "counts": dict(sorted(counts.items())),
        "numeric": {"total": len(numeric), "passed": len(passed)},
        "validation": {"total": len(validation), "passed": sum(r.status == PASS for r in validation)},
        "reasons": _reasons(failing) if failing else _reasons(others),
        "repro": [r.repro for r in failing[:3]],
    }


def rows(run: BackendRun) -> list[dict[str, Any]]:
    by: dict[tuple[str, str], list[Result]] = {}
    for r in run.results:
        by.setdefault((r.op, r.dtype), []).append(r)
    return [row(op, dt, by.get((op, dt), [])) for op, spec in OPS.items() for dt in spec.dtype_axis]


def determinism(run: BackendRun) -> list[dict[str, Any]]:
    """Per op and claim (run_to_run, batch_invariant, tie_rule): holds, broken, not claimed, not checked."""
    out = []
    for op in OPS:
        for what, v in run.determinism.get(op, {}).items():
            if v["claimed"] is None:
                verdict = "not applicable"
            elif v["claimed"] is False:
                verdict = "not claimed"
            elif v["fail"]:
                verdict = "broken"
            elif v["pass"]:
                verdict = "holds"
            else:
                verdict = "not checked"
            out.append({"op": op, "claim": what, "verdict": verdict, "pass": v["pass"], "fail": v["fail"]})
    return out


def remaining(backend, table: list[dict[str, Any]], needed, model: dict[str, Any]) -> list[dict[str, Any]]:
    """What stands between the backend and the run: each needed op/dtype not passing, a needed cache
    layout or backward not claimed, and each model-level check that does not pass."""
    state = {(r["op"], r["dtype"]): r for r in table}
    out = []
    for n in needed:
        r = state[(n.op, n.dtype)]
        caps = backend.capabilities(n.op)
        why = []
        if n.op in backend.borrowed:
            why.append("borrowed from the reference (host copies): not ported")
        elif r["state"] not in ("passing", "partial"):
            why.append(f"conformance {r['state']}" + (f": {r['reasons'][0]}" if r["reasons"] else ""))
        if caps is not None:
            missing = sorted(n.layouts - set(caps.layouts))
            if missing and OPS[n.op].cache_arg:
                why.append(f"layouts {missing} not claimed")
            if n.backward and not caps.differentiable:
                why.append("backward needed (training), not claimed differentiable")
        if why:
            out.append({"what": f"{n.op}/{n.dtype}", "why": "; ".join(why)})
    for check, res in model.items():
        if res["status"] not in ("pass", "not applicable", "skipped"):
            out.append({"what": f"model check {check}", "why": f"{res['status']}: {res['detail']}"})
    return out


class StatusError(ValueError):
    """A bad --from-json file (one line naming it)."""


def load_run(path: str, name: str) -> tuple[BackendRun, str]:
    """One backend's run from a `glm5 conformance --json` file, and the suite it ran."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        results = [
            Result(
                r["op"],
                r["backend"],
                r["dtype"],
                r["case"],
                r["status"],
                kernel_calls=r.get("kernel_calls", 0),
                repro=r.get("repro", ""),
                message=r.get("message", ""),
                tags=r.get("tags", {}),
            )
            for r in data["results"]
            if r["backend"] == name
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StatusError(f"--from-json: cannot read a conformance JSON from {path!r}: {exc}") from None
    if not results:
        raise StatusError(f"--from-json: {path!r} has no results of backend {name!r}")
    man = data.get("manifest", {}).get(name, {})
    run = BackendRun(
        name,
        data.get("environment", {}).get(name, {}),
        results,
        [c for c in data.get("claims", []) if c.get("backend") == name],
        data.get("determinism", {}).get(name, {}),
        man.get("unused", []),
        man.get("path"),
    )
    return run, data.get("report", {}).get("suite", f"from {path}")


def build(
    name: str,
    suite: str = "quick",
    need: Need = Need(),
    model_checks: bool = True,
    console=None,
    conformance_json: str | None = None,
    from_json: str | None = None,
) -> dict[str, Any]:
    import backends
    from conformance import report
    from conformance.cli import run_backends
    from glm5.port import model_checks as mc
    from glm5.port.needs import derive

    be = backends.get(name)  # BackendUnavailable (with the reason) before any work
    needed, ran = derive(need.config, need.recipes, need.dtype, need.train)
    if from_json:
        run, suite = load_run(from_json, name)
        runs = [run]
    else:
        runs = run_backends([name], None, suite, None, None, console)
    if conformance_json:
        report.write_json(runs, conformance_json)
    run = runs[0]
    table = rows(run)
    before = be.borrow_ledger.snapshot()
    if model_checks:
        model = {"greedy_tokens": mc.greedy(name), "shadow": mc.shadow(name)}
    else:
        model = {k: {"status": "skipped", "detail": "--no-model"} for k in ("greedy_tokens", "shadow")}
    borrowed = borrow_costs(be, before, measured=model_checks)
    states = Counter(r["state"] for r in table)
    needed_keys = {(n.op, n.dtype) for n in needed}
    needed_ok = sum(
        r["state"] in ("passing", "partial") for r in table if (r["op"], r["dtype"]) in needed_keys
    )
    return {
        "backend": name,
        "suite": suite,
        "environment": run.environment,
        "conformance_summary": summary(runs)[name],
        "rows_total": len(table),
        "rows_passing": states["passing"],
        "rows": table,
        "states": {s: states[s] for s in STATES},
        "determinism": determinism(run),
        "claims": [c for c in run.claims if c["verdict"] != "ok"],
        "model_checks": model,
        "borrowed": borrowed,
        "needs": {
            **ran,
            "ops": [n.to_json() for n in needed],
            "ready": needed_ok,
            "total": len(needed_keys),
        },
        "remaining": remaining(be, table, needed, model),
        "manifest": {"path": run.manifest, "unused": run.unused},
    }


def borrow_costs(be, before: dict[str, dict[str, Any]], measured: bool) -> list[dict[str, Any]]:
    """Per borrowed op, what borrowing it cost over the model-level checks (the conformance suite never
    runs a borrowed op: it would compare the reference with itself)."""
    out = []
    for op in sorted(be.borrowed):
        now, was = be.borrow_ledger.cost(op), before.get(op, {})
        cost = {k: round(v - was.get(k, 0), 6) for k, v in now.items()} if measured else None
        out.append({"op": op, "cost": cost})
    return out


def _cost_text(cost: dict[str, Any] | None) -> str:
    if cost is None:
        return "cost not measured (--no-model)"
    mb = (cost["bytes_to_host"] + cost["bytes_to_device"]) / 1e6
    return f"{cost['calls']} calls, {mb:.3f} MB copied, {cost['seconds']:.3f} s over the model checks"


def headline(rep: dict[str, Any]) -> str:
    s, n, m = rep["states"], rep["needs"], rep["model_checks"]
    recipe = f" + {', '.join(n['recipes'])}" if n["recipes"] else ""
    return (
        f"{rep['backend']}: {rep['rows_passing']} of {rep['rows_total']} op x dtype rows passing "
        f"({s['partial']} partial, {s['failing']} failing, {s['borrowed']} borrowed, "
        f"{s['unsupported']} unsupported, "
        f"{s['skipped']} skipped, {s['not run']} not run); "
        f"GLM-5 {n['config']}{recipe} ({n['dtype']}) needs {n['total']} rows, {n['ready']} ready; "
        f"model: greedy {m['greedy_tokens']['status']}, shadow {m['shadow']['status']}; "
        f"{len(rep['remaining'])} items remaining"
    )


def to_markdown(rep: dict[str, Any]) -> str:
    out = [f"# Porting status: {rep['backend']}", "", headline(rep), ""]
    out += [
        f"Conformance suite `{rep['suite']}`: "
        + ", ".join(f"{k} {v}" for k, v in rep["conformance_summary"].items() if k != "ok"),
        "",
        "## Ops",
        "",
        "| op | dtype | state | numeric passed | validation passed | matrix cell | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        why = (r["reasons"][0] if r["reasons"] else "").replace("|", "\\|")
        num, val = r["numeric"], r["validation"]
        out.append(
            f"| {r['op']} | {r['dtype']} | {r['state']} | {num['passed']}/{num['total']} | "
            f"{val['passed']}/{val['total']} | {r['cell']} | {why[:160]} |"
        )
    out += [
        "",
        "## Determinism claims",
        "",
        "| op | claim | verdict | passed | failed |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {d['op']} | {d['claim']} | {d['verdict']} | {d['pass']} | {d['fail']} |"
        for d in rep["determinism"]
    ]
    if rep["borrowed"]:
        out += ["", "## Borrowed ops (the reference on host copies)", ""]
        out += [f"- {b['op']}: {_cost_text(b['cost'])}" for b in rep["borrowed"]]
    out += ["", "## Model-level checks (tiny GLM-5)", ""]
    for k, v in rep["model_checks"].items():
        out.append(f"- **{k}**: {v['status']}: {v['detail']}")
    n = rep["needs"]
    out += ["", f"## What GLM-5 needs ({n['config']}, recipes {n['recipes'] or 'none'}, {n['dtype']})", ""]
    out += [f"Derived by running: {', '.join(n['ran'])}.", "", "| op | dtype | layouts | backward | calls |"]
    out += ["|---|---|---|---|---|"]
    out += [
        f"| {o['op']} | {o['dtype']} | {', '.join(o['layouts']) or '-'} | {o['backward']} | {o['calls']} |"
        for o in n["ops"]
    ]
    out += ["", "## Remaining", ""]
    out += [f"- {x['what']}: {x['why']}" for x in rep["remaining"]] or [
        "- nothing found: every op x dtype the run needs passes its conformance cases, and the model-level "
        "checks pass (real shapes and speed are checked on the chip, not here)"
    ]
    return "\n".join(out) + "\n"


def write_json(rep: dict[str, Any], path: str) -> None:
    from conformance.report import write_text_report

    write_text_report(path, json.dumps(rep, indent=1, default=str))


def write_markdown(rep: dict[str, Any], path: str) -> None:
    from conformance.report import write_text_report

    write_text_report(path, to_markdown(rep))


def render(rep: dict[str, Any], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    colors = {"passing": "green", "partial": "yellow", "failing": "red", "borrowed": "yellow"}
    colors |= {"unsupported": "dim", "skipped": "dim", "not run": "dim"}
    table = Table(title=f"Porting status of {rep['backend']} (suite {rep['suite']})")
    for col in ("op", "dtype", "state", "numeric", "validation"):
        table.add_column(col, no_wrap=True)
    table.add_column("reason", overflow="ellipsis", no_wrap=True, max_width=70)
    for r in rep["rows"]:
        num, val = r["numeric"], r["validation"]
        table.add_row(
            r["op"],
            r["dtype"],
            f"[{colors[r['state']]}]{r['state']}[/]",
            f"{num['passed']}/{num['total']}",
            f"{val['passed']}/{val['total']}",
            escape(r["reasons"][0] if r["reasons"] else ""),
        )
    console.print(table)
    for d in rep["determinism"]:
        if d["verdict"] not in ("holds", "not applicable"):
            console.print(f"[yellow]determinism[/] {d['op']} {d['claim']}: {d['verdict']}")
    for b in rep["borrowed"]:
        console.print(f"[yellow]borrowed[/] {b['op']}: {_cost_text(b['cost'])}")
    for k, v in rep["model_checks"].items():
        console.print(f"model {k}: {v['status']}: {escape(v['detail'])}")
    for x in rep["remaining"]:
        console.print(f"[yellow]remaining[/] {x['what']}: {escape(x['why'])}")
    console.print(headline(rep))
