"""The porting guide's quick start, followed literally: the commands and the ported op are read from
docs/porting.md and run in order (generate, pip install -e, conformance: 0 passing, port one op by
delegating to torch, conformance: its rows pass, port status), and the time from `port init` to the first
passing op is measured.

`pip install -e` goes into a throwaway virtual environment layered over this one (a .pth adds this
environment's site-packages), so the plugin never appears in the shared environment and nothing needs
uninstalling; the environment is deleted with tmp_path.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from backends.contract.ops import OPS
from conformance.report import BackendRun
from conformance.result import PASS, UNSUPPORTED, Result
from glm5.port import status
from glm5.port.example import EXAMPLE_OP, EXAMPLE_OP_NAME
from glm5.port.init import REASON

DOC = Path(__file__).resolve().parents[2] / "docs" / "porting.md"
QUICKSTART = re.compile(r"<!-- quickstart:start -->(.*?)<!-- quickstart:end -->", re.S)
BLOCK = re.compile(r"```(console|python)\n(.*?)```", re.S)


def quickstart() -> list[tuple[str, str]]:
    """The quick start's code blocks in order: ("console", commands) and ("python", file text)."""
    text = QUICKSTART.search(DOC.read_text(encoding="utf-8"))
    assert text, f"{DOC}: no <!-- quickstart:start --> ... <!-- quickstart:end --> section"
    return BLOCK.findall(text.group(1))


def overlay_env(root: Path) -> Path:
    """A virtual environment whose site-packages also holds this environment's (the installed glm5-backends,
    torch, pip, setuptools); returns its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    main = sysconfig.get_paths()["purelib"]
    (Path(site) / "_glm5_main_env.pth").write_text(f"import site; site.addsitedir({main!r})\n")
    return py


def argv(py: Path, line: str) -> list[str]:
    """A documented command as this environment runs it."""
    words = line.split()
    if words[0] == "glm5":
        return [str(py), "-m", "glm5.cli", *words[1:]]
    if words[:2] == ["pip", "install"]:
        # offline, against the glm5-backends already installed: no build isolation, no dependency resolution
        return [
            str(py),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            *words[2:],
        ]
    raise AssertionError(f"the quick start has a command this test cannot run: {line!r}")


def run(py: Path, line: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv(py, line), cwd=cwd, capture_output=True, text=True, timeout=900)


def run_from_json(path: Path) -> BackendRun:
    data = json.loads(path.read_text())
    results = [
        Result(
            r["op"], r["backend"], r["dtype"], r["case"], r["status"], message=r["message"], repro=r["repro"]
        )
        for r in data["results"]
    ]
    return BackendRun(results[0].backend, {}, results, [], data["determinism"][results[0].backend])


def test_bad_names_and_existing_directory(tmp_path):
    from glm5.port.cli import port

    cli = CliRunner()
    for bad, says in (
        ("My-Chip", "lowercase Python identifier"),
        ("reference", "built-in backend"),
        ("class", "identifier"),
    ):
        out = cli.invoke(port, ["init", bad, "--dir", str(tmp_path / "x")])
        assert out.exit_code == 2, out.output
        assert says in out.output and len(out.output.strip().splitlines()) == 1, out.output
        assert not (tmp_path / "x").exists()
    target = tmp_path / "glm5-mychip"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    out = cli.invoke(port, ["init", "mychip", "--dir", str(target)])
    assert out.exit_code == 2 and "--force" in out.output and len(out.output.strip().splitlines()) == 1
    assert sorted(p.name for p in target.iterdir()) == ["mine.txt"]
    out = cli.invoke(port, ["init", "mychip", "--dir", str(target), "--force"])
    assert out.exit_code == 0, out.output
    assert (target / "mine.txt").read_text() == "keep" and (target / "glm5_mychip" / "topk.py").is_file()


@pytest.mark.slow
def test_quickstart_from_nothing_to_a_passing_op(tmp_path, record_property):
    blocks = quickstart()
    kinds = [k for k, _ in blocks]
    assert kinds == ["console", "python", "console"], kinds
    assert blocks[1][1] == EXAMPLE_OP, "the guide's ported op must be glm5/port/example.py's EXAMPLE_OP"
    before = [line[2:] for line in blocks[0][1].splitlines() if line.startswith("$ ")]
    after = [line[2:] for line in blocks[2][1].splitlines() if line.startswith("$ ")]
    name = before[0].split()[3]
    pkg_dir = tmp_path / before[0].split("--dir")[1].split()[0]
    py = overlay_env(tmp_path)

    t0 = time.perf_counter()
    for line in before:
        proc = run(py, line, tmp_path)
        # conformance may exit 1 on failing cases (checked below), never on a usage error or a crash
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (
            f"{line}\n{proc.stdout}\n{proc.stderr}"
        )
    first = run_from_json(tmp_path / "before.json")
    numeric = [r for r in first.results if not r.case.startswith("errors/")]
    assert numeric and all(r.status == UNSUPPORTED and r.message == REASON for r in numeric)
    table = status.rows(first)
    assert len(table) == sum(len(s.dtype_axis) for s in OPS.values())
    assert sum(r["state"] == "passing" for r in table) == 0

    # port the op exactly as the guide says: the whole module replaced by the guide's text
    op_file = pkg_dir / f"glm5_{name}" / f"{EXAMPLE_OP_NAME}.py"
    assert f"glm5_{name}/{EXAMPLE_OP_NAME}.py" in DOC.read_text()
    op_file.write_text(blocks[1][1])
    proc = run(py, after[0], tmp_path)
    elapsed = time.perf_counter() - t0
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    second = run_from_json(tmp_path / "after.json")
    mine = [r for r in second.results if r.op == EXAMPLE_OP_NAME]
    assert mine and all(r.status == PASS for r in mine), [(r.case, r.status, r.message) for r in mine]
    rows = {(r["op"], r["dtype"]): r["state"] for r in status.rows(second)}
    assert {dt for (op, dt), s in rows.items() if s == "passing"} and all(
        (s == "passing") == (op == EXAMPLE_OP_NAME) for (op, _), s in rows.items()
    ), rows
    record_property("port_init_to_first_passing_op_s", round(elapsed, 1))
    print(f"\nport init -> first passing op ({EXAMPLE_OP_NAME}): {elapsed:.1f} s")

    for line in after[1:]:
        proc = run(py, line, tmp_path)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
    rep = json.loads((tmp_path / "status.json").read_text())
    assert rep["rows_passing"] == 3 and rep["rows_total"] == len(table)
    # the report's numbers are those of a conformance run of the same selection (after.json: the full suite)
    assert [(r["op"], r["dtype"], r["counts"]) for r in rep["rows"]] == [
        (r["op"], r["dtype"], r["counts"]) for r in status.rows(second)
    ]
    assert rep["model_checks"]["greedy_tokens"]["status"] == "unsupported"
    assert any(x["what"].startswith("indexer_topk/") for x in rep["remaining"])

    # the generated package's own pytest file runs the suite on it
    proc = subprocess.run(
        [
            str(py),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            EXAMPLE_OP_NAME,
            str(pkg_dir / "tests"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout + proc.stderr
