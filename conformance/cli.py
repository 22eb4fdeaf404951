"""`glm5 conformance`: run the conformance suite against one or more backends.

glm5 conformance --backend reference --suite full --json out.json --junit out.xml --markdown out.md
glm5 conformance --backend cuda --ops topk --case 'adversarial/ties*' --dtype float16
"""

from __future__ import annotations

import datetime
import sys

import click

from conformance.case import SUITE_SETS


def _split(values) -> list[str]:
    out: list[str] = []
    for v in values or ():
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def run_backends(
    names: list[str],
    ops: list[str] | None,
    suite: str,
    case_glob: str | None,
    dtypes: list[str] | None,
    console=None,
):
    """Run the selection on each backend; returns the list of `report.BackendRun`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import backends
    from conformance import cases
    from conformance.report import BackendRun
    from conformance.result import FAILING
    from conformance.runner import Runner

    runs = []
    for name in names:
        be = backends.get(name)
        selection = cases.for_backend(be, ops, suite, case_glob, dtypes)
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[red]{task.fields[failed]} failing"),
        )
        with Progress(*columns, console=console, transient=True, disable=console is None) as progress:
            task = progress.add_task(name, total=len(selection), failed=0)
            failed = 0

            def on_result(res, task=task, name=name):
                nonlocal failed
                failed += res.status in FAILING
                progress.update(
                    task, advance=1, failed=failed, description=f"{name} {res.op}/{res.dtype}/{res.case}"[:70]
                )

            runner = Runner(be, on_result=on_result)
            results = runner.run(selection)
        runs.append(
            BackendRun(
                name,
                runner.env,
                results,
                runner.claims(),
                runner.determinism,
                [e.describe() for e in runner.manifest.unused()],
                runner.manifest.path,
            )
        )
    return runs


def _statuses(known: list[tuple[str, bool, str]], selected: list[str]) -> dict[str, dict[str, str]]:
    """Every known backend's status before the run: selected, skipped (not selected) or not available."""
    out = {}
    for n, ok, why in known:
        if selected:
            st, reason = ("selected", "") if n in selected else ("skipped", "not selected (--backend)")
        else:
            st, reason = ("selected", "") if ok else ("not available", why)
        out[n] = {"name": n, "status": st, "reason": reason}
    return out


@click.command()
@click.option(
    "--backend",
    "backend_names",
    multiple=True,
    help="Backend name (repeatable or comma-separated). Default: every backend available here.",
)
@click.option("--ops", "ops", multiple=True, help="Ops to check, comma-separated (default: all).")
@click.option(
    "--suite",
    type=click.Choice(list(SUITE_SETS)),
    default="full",
    show_default=True,
    help="full = smoke + realistic + adversarial + errors; quick = all but realistic.",
)
@click.option("--case", "case_glob", default=None, help="Glob over case ids, e.g. 'adversarial/ties*'.")
@click.option(
    "--dtype", "dtypes", multiple=True, help="Dtypes of the op's axis, comma-separated (default: all)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write JSON results here.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML here.")
@click.option(
    "--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Write a Markdown matrix here."
)
@click.option("--diff", is_flag=True, help="Compare two backends with each other, case by case.")
def conformance(
    backend_names, ops, suite, case_glob, dtypes, json_path, junit_path, markdown_path, diff
) -> None:
    """Check backends against the CPU reference (docs/spec.md 4): every op x dtype x case, claims both
    ways, determinism claims, proof that the backend's own code ran. Without --backend, every backend
    usable here runs and the report lists every known one (built-in and plugin) with its status and
    the reason it did not run. Exits non-zero on any failure or when zero cases ran."""
    from rich.console import Console
    from rich.markup import escape

    import backends
    from backends.errors import BackendUnavailable
    from conformance import report
    from conformance.manifest import ManifestError

    console = Console(highlight=False, soft_wrap=True)
    known = backends.available()
    names = _split(backend_names)
    unknown = [n for n in names if n not in {k for k, _, _ in known}]
    if unknown:
        raise click.BadParameter(
            f"unknown backend {unknown[0]!r}; known: {', '.join(k for k, _, _ in known)}",
            param_hint="'--backend'",
        )
    statuses = _statuses(known, names)
    names = names or [n for n, ok, _ in known if ok]
    if diff:
        from conformance.diff import main as diff_main

        sel = (_split(ops) or None, suite, case_glob, _split(dtypes) or None)
        sys.exit(diff_main(names, *sel, json_path, console))
    try:
        runs = run_backends(names, _split(ops) or None, suite, case_glob, _split(dtypes) or None, console)
    except (BackendUnavailable, ManifestError, ValueError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(2)
    summ = report.summary(runs)
    for run in runs:
        s = summ[run.backend]
        statuses[run.backend].update(status="ran", reason=f"{s['ran']} cases ran, {s['failing']} failing")
    header = report.Header(
        suite=suite,
        selection={"ops": ",".join(_split(ops)), "case": case_glob or "", "dtype": ",".join(_split(dtypes))},
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        versions=report.versions(),
        backends=list(statuses.values()),
    )
    report.render(runs, console, header)
    if json_path:
        report.write_json(runs, json_path, header)
    if junit_path:
        report.write_junit(runs, junit_path, header)
    if markdown_path:
        report.write_markdown(runs, markdown_path, header)
    sys.exit(report.exit_code(runs))
