"""`glm5 conformance`: reports in every format, fixed matrix denominator, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from click.testing import CliRunner

from backends.contract.ops import OPS
from conformance.cli import conformance


def test_reports_and_fixed_denominator(tmp_path):
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "junit", "markdown")}
    out = CliRunner().invoke(
        conformance,
        [
            "--backend",
            "reference",
            "--ops",
            "topk,dynamic_quant_int8",
            "--suite",
            "smoke",
            *[a for k, p in paths.items() for a in (f"--{k}", p)],
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(paths["json"].read_text())
    assert {"results", "environment", "summary"} <= set(data)
    r = data["results"][0]
    assert {"op", "backend", "dtype", "case", "status", "kernel_calls", "metrics", "repro", "message"} <= set(
        r
    )
    assert data["summary"]["reference"]["ok"] and data["summary"]["reference"]["ran"] == len(data["results"])
    suite = ET.parse(paths["junit"]).getroot().find("testsuite")
    assert int(suite.get("tests")) == len(data["results"]) == len(suite.findall("testcase"))
    md = paths["markdown"].read_text()
    rows = [line for line in md.splitlines() if line.split(" | ")[0].removeprefix("| ") in OPS]
    assert len(rows) == sum(len(s.dtype_axis) for s in OPS.values())  # every op x dtype, selected or not
    # topk smoke: its declared sample (backends/reference/topk.py) and the two of conformance/cases/topk.py
    assert "| w4a8_matmul | float16 | - |" in md and "| topk | float32 | 3/3 |" in md


def test_a_case_glob_that_matches_nothing_is_a_usage_error():
    out = CliRunner().invoke(conformance, ["--backend", "reference", "--case", "no-such-case*"])
    assert out.exit_code == 2 and "'--case'" in out.output and "matches no case" in out.output


def test_bad_arguments_exit_2():
    for args in (
        ["--backend", "no-such-backend"],
        ["--backend", "reference", "--dtype", "bf16"],
        ["--backend", "reference", "--ops", "topkk"],
    ):
        out = CliRunner().invoke(conformance, args)
        assert out.exit_code == 2, (args, out.output)


def test_report_lists_every_known_backend_with_status_suite_date_and_versions(tmp_path, monkeypatch):
    import backends

    real = backends.available

    def with_ghost():  # a plugin that cannot run here must still appear, with its reason
        return [*real(), ("ghost", False, "ghost needs a haunted device")]

    monkeypatch.setattr(backends, "available", with_ghost)
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "junit", "markdown")}
    out = CliRunner().invoke(
        conformance,
        [
            "--ops",
            "topk",
            "--suite",
            "smoke",
            "--case",
            "smoke/random*",
            *[a for k, p in paths.items() for a in (f"--{k}", p)],
        ],
    )
    assert out.exit_code == 0, out.output
    rep = json.loads(paths["json"].read_text())["report"]
    assert rep["suite"] == "smoke" and rep["date"].endswith("UTC") and "torch" in rep["versions"]
    status = {b["name"]: b for b in rep["backends"]}
    assert set(status) == {n for n, _, _ in with_ghost()}
    for n, ok, why in with_ghost():
        assert status[n]["status"] == ("ran" if ok else "not available"), status[n]
        if not ok:
            assert status[n]["reason"] == why
    assert "ghost" in out.output and "haunted" in out.output
    md = paths["markdown"].read_text()
    assert "| ghost | not available | ghost needs a haunted device |" in md and "Versions:" in md
    skipped = [s for s in ET.parse(paths["junit"]).getroot() if s.get("name") == "conformance.ghost"]
    assert len(skipped) == 1 and skipped[0].get("skipped") == "1"


def test_reference_alone_says_it_compared_with_itself(tmp_path):
    out = CliRunner().invoke(
        conformance,
        ["--backend", "reference", "--ops", "topk", "--suite", "smoke", "--json", tmp_path / "r.json"],
    )
    assert out.exit_code == 0, out.output
    rep = json.loads((tmp_path / "r.json").read_text())["report"]
    assert any("only the reference ran" in n for n in rep["notes"])
    assert {b["status"] for b in rep["backends"] if b["name"] != "reference"} == {"skipped"}


def test_help_names_every_suite_full_and_quick_run():
    from conformance.case import SUITE_SETS

    text = " ".join(CliRunner().invoke(conformance, ["--help"]).output.split())
    for name in ("full", "quick"):
        assert f"{name} = {' + '.join(SUITE_SETS[name])}" in text, text


def test_the_readme_main_job_writes_its_reports_where_git_ignores_them():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text().splitlines()
    line = next(ln for ln in readme if "glm5 conformance --suite" in ln)
    ignored = [ln.strip("/") for ln in (root / ".gitignore").read_text().splitlines() if ln.startswith("/")]
    for opt in ("--json", "--markdown"):
        path = line.split(f"{opt} ", 1)[1].split()[0]
        assert Path(path).parts[0] in ignored, (opt, path)
