"""`glm5 conformance`: reports in every format, fixed matrix denominator, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from click.testing import CliRunner

from backends.ops import OPS
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
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| op ")]
    assert len(rows) == sum(len(s.dtype_axis) for s in OPS.values())  # every op x dtype, selected or not
    assert "| w4a8_matmul | float16 | - |" in md and "| topk | float32 | 2/2 |" in md


def test_zero_cases_is_a_failure():
    out = CliRunner().invoke(conformance, ["--backend", "reference", "--case", "no-such-case*"])
    assert out.exit_code == 1 and "zero cases ran" in out.output


def test_bad_arguments_exit_2():
    for args in (
        ["--backend", "no-such-backend"],
        ["--backend", "reference", "--dtype", "bf16"],
        ["--backend", "reference", "--ops", "topkk"],
    ):
        out = CliRunner().invoke(conformance, args)
        assert out.exit_code == 2, (args, out.output)
