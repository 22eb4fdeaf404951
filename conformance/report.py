"""Reports of a conformance run: coverage matrix (fixed denominator: every op of `backends.contract.ops.OPS` x
every dtype of its axis, whatever is claimed), failures with their worst elements and repro line,
claims checked both ways, determinism claims, unused manifest entries; as rich console output, JSON,
JUnit XML and Markdown."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.contract.ops import OPS
from conformance.result import BORROWED, FAILING, PASS, RAN, SKIPPED, UNSUPPORTED, XFAIL, Result


@dataclass
class Header:
    """What a report is about: the selection, when, on what versions, and every known backend's status
    (`ran`, `not available` with the reason, or `skipped` when not selected), so a report of a plain
    install says which backends were not checked and why instead of silently comparing fewer."""

    suite: str
    selection: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    backends: list[dict[str, str]] = field(default_factory=list)

    def notes(self) -> list[str]:
        ran = [b["name"] for b in self.backends if b["status"] == "ran"]
        if ran and set(ran) <= {"reference"}:
            return [
                "only the reference ran: it is the oracle, so each comparison is with itself (a check of "
                "the suite, not of a backend); the backends above that did not run say why"
            ]
        return []

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "selection": self.selection,
            "date": self.date,
            "versions": self.versions,
            "backends": self.backends,
            "notes": self.notes(),
        }


def versions() -> dict[str, str]:
    """Versions of what a conformance result depends on."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("glm5-backends", "torch", "numpy", "triton", "onnxruntime", "triton-ascend", "torch_npu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def status_line(b: dict[str, str]) -> str:
    return f"{b['name']}: {b['status']}" + (f" ({b['reason']})" if b.get("reason") else "")


@dataclass
class BackendRun:
    """Everything one backend's run produced."""

    backend: str
    environment: dict[str, str]
    results: list[Result]
    claims: list[dict[str, Any]] = field(default_factory=list)
    determinism: dict[str, Any] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    manifest: str | None = None


def _computes(r: Result) -> bool:
    """A case that exercises the backend's own computation: errors/ cases check argument validation,
    which the shared front door does for every backend, so they never make a backend count as working."""
    return not r.case.startswith("errors/")


def summary(runs: Sequence[BackendRun]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in runs:
        c = Counter(r.status for r in run.results)
        ran = sum(c[s] for s in RAN)
        failing = sum(c[s] for s in FAILING)
        computed = sum(1 for r in run.results if _computes(r) and r.status in RAN)
        only_errors = not any(_computes(r) for r in run.results)  # e.g. --suite errors
        out[run.backend] = {
            "total": len(run.results),
            "ran": ran,
            "ran_computing": computed,
            "failing": failing,
            **dict(sorted(c.items())),
            "ok": failing == 0 and (computed > 0 or (only_errors and ran > 0)),
        }
    return out


def exit_code(runs: Sequence[BackendRun]) -> int:
    """Non-zero on any failure, and when a selected backend computed nothing (every case but the
    front door's errors/ ones skipped or unsupported)."""
    if not runs:
        return 1
    return 0 if all(s["ok"] for s in summary(runs).values()) else 1


def cell(results: Sequence[Result]) -> str:
    """'12/12', 'unsupported', 'borrowed', '10/12 (1 xfail, 1 unsupported)' or '-' (nothing selected).
    errors/ cases (argument validation, done by the shared front door) do not count: a backend that
    computes none of an op's cases shows 'unsupported' whatever its errors/ cases did."""
    if not results:
        return "-"
    results = [r for r in results if _computes(r)] or results  # errors/ alone: --suite errors
    c = Counter(r.status for r in results)
    if c[UNSUPPORTED] == len(results):
        return "unsupported"
    if c[BORROWED] == len(results):  # the reference ran, not the backend: never a pass count
        return "borrowed"
    ran = [r for r in results if r.status not in (UNSUPPORTED, SKIPPED, BORROWED)]
    text = f"{c[PASS]}/{len(ran)}" if ran else "0/0"
    extra = [f"{c[s]} {s.lower()}" for s in (XFAIL, UNSUPPORTED, SKIPPED, BORROWED) if c[s]]
    return text + (f" ({', '.join(extra)})" if extra else "")


def coverage(runs: Sequence[BackendRun]) -> list[dict[str, str]]:
    """Rows (op, dtype) x one column per backend; the rows are fixed by the op table."""
    rows = []
    for op, spec in OPS.items():
        for dt in spec.dtype_axis:
            row = {"op": op, "dtype": dt}
            for run in runs:
                row[run.backend] = cell([r for r in run.results if r.op == op and r.dtype == dt])
            rows.append(row)
    return rows


def failures(runs: Sequence[BackendRun]) -> list[Result]:
    return [r for run in runs for r in run.results if r.status in FAILING]


def to_json(runs: Sequence[BackendRun], header: Header | None = None) -> dict[str, Any]:
    return {
        **({"report": header.to_json()} if header else {}),
        "results": [r.to_json() for run in runs for r in run.results],
        "environment": {run.backend: run.environment for run in runs},
        "summary": summary(runs),
        "coverage": coverage(runs),
        "claims": [c for run in runs for c in run.claims],
        "determinism": {run.backend: run.determinism for run in runs},
        "manifest": {run.backend: {"path": run.manifest, "unused": run.unused} for run in runs},
    }


def output_problem(path: str | os.PathLike) -> str | None:
    """Why a report cannot be written to the file `path` (None: it can), checked before a run so that a
    typo does not lose the report at its end: the parent must be a writable directory, the path not a
    directory nor anything but a regular file."""
    p = Path(path)
    parent = p.absolute().parent
    if p.is_dir():
        return f"{str(p)!r} is a directory; expected a file path"
    if p.exists() and not p.is_file():
        return f"{str(p)!r} exists and is not a regular file"
    if not parent.exists():
        return f"{str(p)!r}: directory {str(parent)!r} does not exist"
    if not parent.is_dir():
        return f"{str(p)!r}: {str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{str(p)!r}: directory {str(parent)!r} is not writable"
    return None


def write_text_report(path: str | os.PathLike, text: str) -> None:
    """Replace the report at `path` in one step (a reader sees the old report or the new, never half)."""
    from glm5.infra.fsio import write_text_atomic

    write_text_atomic(path, text)


def write_json(runs: Sequence[BackendRun], path: str, header: Header | None = None) -> None:
    write_text_report(path, json.dumps(to_json(runs, header), indent=1, default=str))


def failure_text(r: Result) -> str:
    lines = [f"{r.status} {r.backend} {r.op}/{r.dtype}/{r.case}: {r.message}"]
    if r.inputs:
        lines.append(f"  inputs: {r.inputs}")
    for c in r.checks:
        if not c.ok and c.worst:
            lines.append(f"  worst elements of {c.output}:")
            for w in c.worst:
                lines.append(
                    f"    at {w['index']}: actual {w['actual']!r}, expected {w['expected']!r}, "
                    f"allowed {w['allowed']!r}"
                )
    lines.append(f"  repro: {r.repro}")
    return "\n".join(lines)


def write_junit(runs: Sequence[BackendRun], path: str, header: Header | None = None) -> None:
    root = ET.Element("testsuites")
    for run in runs:
        s = summary([run])[run.backend]
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"conformance.{run.backend}",
            tests=str(len(run.results)),
            failures=str(s.get("FAIL", 0) + s.get("XPASS", 0)),
            errors=str(s.get("ERROR", 0)),
            skipped=str(sum(s.get(k, 0) for k in (SKIPPED, UNSUPPORTED, XFAIL, BORROWED))),
        )
        for r in run.results:
            tc = ET.SubElement(
                suite,
                "testcase",
                classname=f"conformance.{run.backend}.{r.op}",
                name=f"{r.op}/{r.dtype}/{r.case}",
                time=f"{r.seconds:.4f}",
            )
            if r.status in ("FAIL", "XPASS"):
                ET.SubElement(tc, "failure", message=r.message[:500]).text = failure_text(r)
            elif r.status == "ERROR":
                ET.SubElement(tc, "error", message=r.message[:500]).text = failure_text(r)
            elif r.status in (SKIPPED, UNSUPPORTED, XFAIL, BORROWED):
                ET.SubElement(tc, "skipped", message=f"{r.status}: {r.message}"[:500])
    ran = {run.backend for run in runs}
    for b in header.backends if header else []:
        if b["name"] not in ran:  # one skipped case per backend that did not run, with the reason
            suite = ET.SubElement(
                root,
                "testsuite",
                name=f"conformance.{b['name']}",
                tests="1",
                failures="0",
                errors="0",
                skipped="1",
            )
            tc = ET.SubElement(suite, "testcase", classname=f"conformance.{b['name']}", name="backend")
            ET.SubElement(tc, "skipped", message=status_line(b)[:500])
    write_text_report(path, ET.tostring(root, encoding="unicode", xml_declaration=True))


def _markdown_header(header: Header) -> list[str]:
    sel = ", ".join(f"{k} {v}" for k, v in header.selection.items() if v) or "everything"
    out = [
        f"Suite **{header.suite}** ({sel}), {header.date}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in header.versions.items()) + ".",
        "",
        "| backend | status | reason |",
        "|---|---|---|",
    ]
    for b in header.backends:
        reason = b.get("reason", "").replace("|", "\\|")
        out.append(f"| {b['name']} | {b['status']} | {reason} |")
    out += [""] + [f"**Note:** {n}" for n in header.notes()] + ([""] if header.notes() else [])
    return out


def to_markdown(runs: Sequence[BackendRun], header: Header | None = None) -> str:
    names = [run.backend for run in runs]
    out = [
        "# Conformance coverage",
        "",
        *(_markdown_header(header) if header else []),
        "Every op of the contract x every dtype of its axis, whatever each backend claims; a cell is "
        "passed/ran.",
        "",
        "| op | dtype | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in coverage(runs):
        out.append(f"| {row['op']} | {row['dtype']} | " + " | ".join(row[n] for n in names) + " |")
    out += ["", "## Summary", ""]
    for name, s in summary(runs).items():
        out.append(f"- **{name}**: " + ", ".join(f"{k} {v}" for k, v in s.items() if k not in ("ok",)))
    fails = failures(runs)
    if fails:
        out += ["", "## Failures", ""]
        for r in fails:
            out += ["```", failure_text(r), "```"]
    claims = [c for run in runs for c in run.claims if c["verdict"] != "ok"]
    if claims:
        out += ["", "## Claims", ""]
        out += [f"- {c['backend']} {c['op']}/{c['dtype']}: {c['verdict']}" for c in claims]
    return "\n".join(out) + "\n"


def write_markdown(runs: Sequence[BackendRun], path: str, header: Header | None = None) -> None:
    write_text_report(path, to_markdown(runs, header))


def render_header(header: Header, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    sel = ", ".join(f"{k} {v}" for k, v in header.selection.items() if v) or "everything"
    table = Table(title=f"Backends (suite {header.suite}: {escape(sel)}; {header.date})")
    for col in ("backend", "status", "reason"):
        table.add_column(col)
    colors = {"ran": "green", "not available": "red", "skipped": "dim"}
    for b in header.backends:
        c = colors.get(b["status"], "yellow")
        table.add_row(b["name"], f"[{c}]{b['status']}[/]", escape(b.get("reason", "")))
    console.print(table)
    text = ", ".join(f"{k} {v}" for k, v in header.versions.items())
    console.print(f"[dim]versions: {escape(text)}[/]")


def render(runs: Sequence[BackendRun], console, header: Header | None = None) -> None:
    """The console report (rich)."""
    from rich.markup import escape
    from rich.table import Table

    if header:
        render_header(header, console)

    table = Table(title="Conformance coverage (passed/ran per op x dtype)")
    table.add_column("op")
    table.add_column("dtype")
    for run in runs:
        table.add_column(run.backend)
    for row in coverage(runs):
        cells = []
        for run in runs:
            v = row[run.backend]
            ok = v.split(" ")[0].split("/")
            color = (
                "yellow"
                if v == "borrowed"
                else "dim"
                if v in ("-", "unsupported")
                else ("green" if len(ok) == 2 and ok[0] == ok[1] else "red")
            )
            cells.append(f"[{color}]{escape(v)}[/]")
        table.add_row(row["op"], row["dtype"], *cells)
    console.print(table)
    for r in failures(runs):
        console.print(f"[red]{escape(failure_text(r))}[/]", soft_wrap=True)
    for run in runs:
        for c in run.claims:
            if c["verdict"] != "ok":
                console.print(
                    f"[yellow]claims[/] {run.backend} {c['op']}/{c['dtype']}: {escape(c['verdict'])}"
                )
        for op, d in run.determinism.items():
            for what, v in d.items():
                state = (
                    "not claimed"
                    if v["claimed"] is False
                    else "not applicable"
                    if v["claimed"] is None
                    else f"{v['pass']} passed, {v['fail']} failed"
                )
                if v["claimed"] is not True or v["fail"]:
                    console.print(f"[yellow]determinism[/] {run.backend} {op} {what}: {state}")
        for u in run.unused:
            console.print(f"[yellow]unused manifest entry[/] {run.backend} ({run.manifest}): {escape(u)}")
    for name, s in summary(runs).items():
        color = "green" if s["ok"] else "red"
        text = ", ".join(f"{k} {v}" for k, v in s.items() if k != "ok")
        why = "" if s["ran"] else " (zero cases ran: nothing was checked)"
        console.print(f"[{color}]{name}: {text}{why}[/]")
    for note in header.notes() if header else []:
        console.print(f"[yellow]note:[/] {escape(note)}")
