"""`glm5 conformance`: run the conformance suite against one or more backends.

glm5 conformance --backend reference --suite full --json out.json --junit out.xml --markdown out.md
glm5 conformance --backend cuda --ops topk --case 'adversarial/ties*' --dtype float16
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from pathlib import Path
from typing import Any

import click

from conformance.case import SUITE_SETS


def _split(values) -> list[str]:
    out: list[str] = []
    for v in values or ():
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def bad_glob(glob: str | None) -> str | None:
    """Why `glob` is not a usable --case glob (None: it is): empty, or a '[' that opens no set (fnmatch
    would silently read it as a literal '[', which no case id holds)."""
    if glob is None:
        return None
    if not glob:
        return "expected a glob over case ids, e.g. 'adversarial/ties*', got ''"
    i, n = 0, len(glob)
    while i < n:
        if glob[i] == "[":
            j = i + 1
            j += j < n and glob[j] == "!"
            j += j < n and glob[j] == "]"
            while j < n and glob[j] != "]":
                j += 1
            if j >= n:
                return (
                    f"{glob!r} is not a valid glob: the '[' at position {i} is never closed "
                    "(a literal '[' is '[[]')"
                )
            i = j
        i += 1
    return None


def selections(
    names: list[str],
    ops: list[str] | None,
    suite: str,
    case_glob: str | None,
    dtypes: list[str] | None,
) -> list[tuple[str, Any, list]]:
    """(name, backend, its selected (case, dtype) pairs) for each backend, before anything runs."""
    import backends
    from conformance import cases

    out = []
    for name in names:
        be = backends.get(name)
        out.append((name, be, cases.for_backend(be, ops, suite, case_glob, dtypes)))
    return out


def run_backends(
    names: list[str],
    ops: list[str] | None,
    suite: str,
    case_glob: str | None,
    dtypes: list[str] | None,
    console=None,
    selected: list[tuple[str, Any, list]] | None = None,
):
    """Run the selection on each backend (`selected`: from `selections`, else made here); returns the list
    of `report.BackendRun`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from conformance.report import BackendRun
    from conformance.result import FAILING
    from conformance.runner import Runner

    runs = []
    if selected is None:
        selected = selections(names, ops, suite, case_glob, dtypes)
    for name, be, selection in selected:
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
    help=f"full = {' + '.join(SUITE_SETS['full'])}; quick = {' + '.join(SUITE_SETS['quick'])}.",
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
    problem = bad_glob(case_glob)
    if problem:
        raise click.BadParameter(problem, param_hint="'--case'")
    outputs = check_outputs({"--json": json_path, "--junit": junit_path, "--markdown": markdown_path})
    op_list, dtype_list = _split(ops) or None, _split(dtypes) or None
    with contextlib.ExitStack() as locks:
        lock_outputs(outputs, locks)  # one writer per report, for the whole run
        if diff:
            from conformance.diff import main as diff_main

            sys.exit(diff_main(names, op_list, suite, case_glob, dtype_list, json_path, console))
        selected = _selected(names, op_list, suite, case_glob, dtype_list)
        try:
            runs = run_backends(names, op_list, suite, case_glob, dtype_list, console, selected)
        except (BackendUnavailable, ManifestError, ValueError) as exc:
            click.echo(f"error: {_first_line(exc)}", err=True)
            sys.exit(2)
        _report(runs, statuses, suite, ops, case_glob, dtypes, console, json_path, junit_path, markdown_path)
    sys.exit(report.exit_code(runs))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def check_outputs(paths: dict[str, str | None]) -> dict[str, str]:
    """The report paths given (option -> path), each checked writable before anything runs."""
    from conformance.report import output_problem

    given = {opt: p for opt, p in paths.items() if p}
    seen: dict[str, str] = {}
    for opt, p in given.items():
        problem = output_problem(p)
        if problem:
            raise click.BadParameter(problem, param_hint=f"'{opt}'")
        key = str(Path(p).absolute())
        if key in seen:
            raise click.BadParameter(
                f"{p!r} is also the {seen[key]} report; give each its own file", param_hint=f"'{opt}'"
            )
        seen[key] = opt
    return given


def lock_outputs(outputs: dict[str, str], locks: contextlib.ExitStack) -> None:
    """Take each report's output lock into `locks` (glm5.infra.fsio.one_writer: a second writer is one line
    naming the option)."""
    from glm5.infra.fsio import one_writer

    for opt, p in outputs.items():
        locks.enter_context(one_writer(p, hint=f"'{opt}'"))


#: the selection field a ValueError names ("field: ...") -> its option
_OPTION_OF = {"op": "'--ops'", "dtype": "'--dtype'", "suite": "'--suite'"}


def _selected(names, ops, suite, case_glob, dtypes) -> list[tuple[str, Any, list]]:
    """Every backend's selection, or a usage error naming the option that selects nothing valid."""
    from backends.errors import BackendUnavailable
    from conformance.manifest import ManifestError

    try:
        selected = selections(names, ops, suite, case_glob, dtypes)
    except BackendUnavailable as exc:
        raise click.BadParameter(_first_line(exc), param_hint="'--backend'") from None
    except ManifestError as exc:
        click.echo(f"error: {_first_line(exc)}", err=True)
        sys.exit(2)
    except ValueError as exc:
        field, _, rest = _first_line(exc).partition(": ")
        if rest and field in _OPTION_OF:
            raise click.BadParameter(rest, param_hint=_OPTION_OF[field]) from None
        raise click.UsageError(_first_line(exc)) from None
    if case_glob and selected and not any(sel for _, _, sel in selected):
        raise click.BadParameter(
            f"{case_glob!r} matches no case of suite {suite!r} for the selected ops and dtypes (case ids "
            "look like 'smoke/random_r4_c16_k5' or 'adversarial/ties_*')",
            param_hint="'--case'",
        )
    return selected


def _report(runs, statuses, suite, ops, case_glob, dtypes, console, json_path, junit_path, markdown_path):
    """Console report, then each report file (atomically)."""
    from conformance import report

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
