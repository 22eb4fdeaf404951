"""Bad invocations of the tool commands (`glm5 plan`, `glm5 conformance`, `glm5 port`) end in one line on
stderr naming the argument, exit code 2, before anything runs; their reports are written atomically and
never outside the directory named (issue 21)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from glm5.cli import main
from glm5.deploy.machines import MACHINE_DIR


def _one_error_line(res, word: str) -> None:
    """Exit code 2, one `Error`/`error` line on stderr naming `word`, nothing of it on stdout."""
    assert res.exit_code == 2, (res.output, repr(res.exception))
    assert "Traceback" not in res.output, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.lower().startswith("error")]
    assert len(errors) == 1 and word in errors[0], res.stderr
    assert not any(ln.lower().startswith("error") for ln in res.stdout.splitlines()), res.stdout


# -- glm5 plan ------------------------------------------------------------------------------------------
def _plan_cases(d):
    (d / "list.json").write_text("[1, 2]")
    (d / "dir.json").mkdir()
    (d / "broken.yaml").write_text("a: [\n")
    (d / "list.yaml").write_text("- 1\n")
    return [
        (["--tp", "3"], "--tp"),
        (["--tp", "0"], "--tp"),
        (["--dp", "3"], "--dp"),
        (["--tp", "2", "--dp", "2"], "--tp"),
        (["--tp", "16"], "--tp"),
        (["--nodes", "0"], "--nodes"),
        (["--nodes", "-1"], "--nodes"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--max-model-len", "99999999"], "--max-model-len"),
        (["--spec-tokens", "-1"], "--spec-tokens"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "-3"], "--max-num-batched-tokens"),
        (["--indexer-cache-dtype", "bf16"], "--indexer-cache-dtype"),
        (["--recipe", "nope"], "--recipe"),
        (["--recipe", str(d / "broken.yaml")], "--recipe"),
        (["--recipe", str(d / "list.yaml")], "--recipe"),
        (["--config", str(d / "missing.json")], "--config"),
        (["--config", str(d / "list.json")], "--config"),
        (["--config", str(d / "dir.json")], "--config"),
        (["--machine", str(d / "broken.yaml")], "--machine"),
        (["--model-path", ""], "--model-path"),
    ]


def test_plan_bad_arguments_are_one_line_with_exit_code_2(tmp_path):
    base = {"--machine": "h200x8", "--config": "tiny", "--max-model-len": "1024", "--recipe": "glm5-w8a8"}
    for extra, word in _plan_cases(tmp_path):
        opts = dict(base)
        for k, v in zip(extra[::2], extra[1::2], strict=True):
            opts[k] = v
        res = CliRunner().invoke(main, ["plan", *[x for kv in opts.items() for x in kv]])
        _one_error_line(res, word)


def test_plan_fp8_on_ascend_names_recipe():
    args = [
        "plan",
        "--machine",
        "atlas-800t-a3",
        "--config",
        "tiny",
        "--recipe",
        "fp8",
        "--max-model-len",
        "64",
    ]
    res = CliRunner().invoke(main, args)
    _one_error_line(res, "--recipe")


def test_plan_default_on_h200_is_a_recipe_vllm_serves():
    """h200x8's default is GLM-5-FP8 (vLLM there has no int4 x int8 MoE kernel); W4A8 is refused, with no
    serve command."""
    args = ["plan", "--machine", "h200x8", "--config", "tiny", "--max-model-len", "2048"]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)
    assert p["recipe"] == "fp8" and p["checkpoint_format"] == "fp8"
    assert p["formats"]["vllm"]["W4A8"]["ok"] is False
    assert p["serve_command"].startswith("vllm serve ")
    res = CliRunner().invoke(main, [*args, "--recipe", "glm5-w4a8"])
    _one_error_line(res, "--recipe")
    assert "vllm serve" not in res.output and "cannot serve" in res.stderr


def test_plan_that_does_not_fit_prints_no_serve_command():
    args = [
        "plan",
        "--machine",
        "h200x8",
        "--config",
        "tiny",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.00001",
    ]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 1 and "does not fit" in res.stderr
    p = json.loads(res.stdout)
    assert p["fits"] is False and p["serve_command"] is None and p["serve_commands"] == []


def test_plan_and_conformance_help_still_work():
    for cmd in (["plan", "--help"], ["conformance", "--help"], ["port", "init", "--help"]):
        res = CliRunner().invoke(main, cmd)
        assert res.exit_code == 0 and "Usage" in res.output, res.output
    assert MACHINE_DIR.is_dir()


# -- glm5 conformance -----------------------------------------------------------------------------------
_SMALL = ["conformance", "--backend", "reference", "--ops", "topk", "--suite", "smoke"]


@pytest.mark.parametrize(
    "extra,word",
    [
        (["--ops", "nope"], "--ops"),
        (["--dtype", "nope"], "--dtype"),
        (["--case", "["], "--case"),
        (["--case", "smoke/[ab"], "--case"),
        (["--case", "zzz*"], "--case"),
        (["--json", "{d}/missing/r.json"], "--json"),
        (["--junit", "{d}/missing/r.xml"], "--junit"),
        (["--markdown", "{d}/file.txt/r.md"], "--markdown"),
        (["--json", "{d}/same", "--markdown", "{d}/same"], "--markdown"),
    ],
)
def test_conformance_bad_arguments_are_one_line_on_stderr_before_anything_runs(tmp_path, extra, word):
    (tmp_path / "file.txt").write_text("x")
    args = [a.replace("{d}", str(tmp_path)) for a in extra]
    res = CliRunner().invoke(main, [*_SMALL[:5], *args] if "--ops" in args else [*_SMALL, *args])
    _one_error_line(res, word)
    assert res.stdout == "", res.stdout  # no report: nothing ran
    if word == "--case":
        assert ("never closed" in res.stderr) == ("[" in args[1]), res.stderr
        assert ("matches no case" in res.stderr) == (args[1] == "zzz*"), res.stderr


def test_conformance_reports_are_replaced_atomically(tmp_path):
    """Each report is a new file renamed over the old one, never the old file truncated and rewritten: a
    hard link to the old report (a reader that opened it) still holds the old text."""
    outs = {opt: tmp_path / f"r.{opt}" for opt in ("json", "junit", "markdown")}
    for opt, p in outs.items():
        p.write_text("old report")
        os.link(p, tmp_path / f"old.{opt}")
    res = CliRunner().invoke(main, [*_SMALL, *[a for o, p in outs.items() for a in (f"--{o}", str(p))]])
    assert res.exit_code == 0, res.output
    assert json.loads(outs["json"].read_text())["summary"]["reference"]["ok"]
    assert outs["junit"].read_text().startswith("<?xml") and "| topk |" in outs["markdown"].read_text()
    for opt in outs:
        assert (tmp_path / f"old.{opt}").read_text() == "old report", opt


def test_conformance_report_has_one_writer(tmp_path):
    from glm5.infra.fsio import exclusive, lock_path

    out = tmp_path / "r.json"
    with exclusive(lock_path(out)):  # another run writing the same report
        res = CliRunner().invoke(main, [*_SMALL, "--json", str(out)])
    _one_error_line(res, "--json")
    assert "another process" in res.stderr and not out.exists()


# -- glm5 port ------------------------------------------------------------------------------------------
def test_port_init_never_writes_through_a_symlink_out_of_dir(tmp_path):
    target, outside = tmp_path / "D", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (target / "glm5_mychip").symlink_to(outside)
    res = CliRunner().invoke(main, ["port", "init", "mychip", "--dir", str(target), "--force"])
    _one_error_line(res, "symlink")
    assert list(outside.iterdir()) == [] and sorted(p.name for p in target.iterdir()) == ["glm5_mychip"]


@pytest.fixture(scope="module")
def conformance_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("conf") / "c.json"
    res = CliRunner().invoke(main, [*_SMALL, "--json", str(path)])
    assert res.exit_code == 0, res.output
    return path


def test_port_status_bad_output_is_one_line_before_anything_runs(tmp_path, conformance_json):
    base = ["port", "status", "reference", "--no-model", "--from-json", str(conformance_json)]
    for opt in ("--json", "--markdown", "--conformance-json"):
        res = CliRunner().invoke(main, [*base, opt, str(tmp_path / "missing" / "s.out")])
        _one_error_line(res, opt)
        assert res.stdout == "", res.stdout


def test_port_status_reports_are_replaced_atomically(tmp_path, conformance_json):
    outs = {opt: tmp_path / f"s.{opt}" for opt in ("json", "markdown")}
    for opt, p in outs.items():
        p.write_text("old report")
        os.link(p, tmp_path / f"old.{opt}")
    res = CliRunner().invoke(
        main,
        [
            "port",
            "status",
            "reference",
            "--no-model",
            "--from-json",
            str(conformance_json),
            *[a for o, p in outs.items() for a in (f"--{o}", str(p))],
        ],
    )
    assert res.exit_code in (0, 1), res.output
    assert json.loads(outs["json"].read_text())["backend"] == "reference"
    for opt in outs:
        assert (tmp_path / f"old.{opt}").read_text() == "old report", opt
