"""`glm5 quantize SRC --recipe ... --format ... --out DIR` end to end, and its refusals."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from glm5.cli import main
from quant.load import load_quantized
from tests.quant.conftest import ids, tiny_model


def test_quantize_command_writes_loadable_checkpoints(tmp_path):
    tiny_model(seed=4, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    runner = CliRunner()
    for fmt in ("modelslim", "compressed-tensors"):
        res = runner.invoke(
            main,
            [
                "quantize",
                str(tmp_path / "src"),
                "--recipe",
                "glm5-w4a8",
                "--format",
                fmt,
                "--out",
                str(tmp_path / fmt),
                "--calib-seqs",
                "2",
                "--calib-len",
                "24",
            ],
        )
        assert res.exit_code == 0, res.output
        assert "W4A8_DYNAMIC" in res.output
        model = load_quantized(tmp_path / fmt)
        assert model.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.isfinite(model(ids()).logits.float()).all()
    res = runner.invoke(
        main,
        [
            "quantize",
            str(tmp_path / "src"),
            "--recipe",
            "glm5-w4a8-g128",
            "--format",
            "modelslim",
            "--out",
            str(tmp_path / "bad"),
        ],
    )
    assert res.exit_code != 0 and "per-channel int4 only" in res.output
    res = runner.invoke(
        main,
        [
            "quantize",
            str(tmp_path / "src"),
            "--recipe",
            "nope",
            "--format",
            "modelslim",
            "--out",
            str(tmp_path / "bad"),
        ],
    )
    assert res.exit_code != 0 and "recipe" in res.output


def _q(runner, src, out, *extra):
    return runner.invoke(
        main,
        [
            "quantize",
            "--model",
            str(src),
            "--recipe",
            "glm5-w4a8",
            "--format",
            "compressed-tensors",
            "--out",
            str(out),
            "--calib-seqs",
            "0",
            *extra,
        ],
    )


def _one_line_usage_error(res, *words):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    err = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(err) == 1 and all(w in err[0] for w in words), res.output


def test_quantize_refuses_out_overlapping_the_source_and_existing_out(tmp_path):
    tiny_model(seed=1).save_pretrained(tmp_path / "src")
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    runner = CliRunner()
    for out in (tmp_path / "src", tmp_path / "src" / "q", tmp_path):
        _one_line_usage_error(_q(runner, tmp_path / "src", out), "--out", "overlaps")
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == before
    assert _q(runner, tmp_path / "src", tmp_path / "q").exit_code == 0
    _one_line_usage_error(_q(runner, tmp_path / "src", tmp_path / "q"), "--out", "--overwrite")
    res = _q(runner, tmp_path / "src", tmp_path / "q", "--overwrite")
    assert res.exit_code == 0, res.output
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    res = _q(runner, tmp_path / "src", tmp_path / "junk", "--overwrite")
    _one_line_usage_error(res, "--out", "no checkpoint")
    assert (tmp_path / "junk" / "notes.txt").read_text() == "mine"
    # a quantized checkpoint is not a float source
    _one_line_usage_error(_q(runner, tmp_path / "q", tmp_path / "q2"), "--model", "quantized")


def test_quantize_killed_while_writing_keeps_source_and_previous_out(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    tiny_model(seed=2).save_pretrained(tmp_path / "src")
    runner = CliRunner()
    assert _q(runner, tmp_path / "src", tmp_path / "q").exit_code == 0
    cmd = [
        sys.executable,
        "-m",
        "glm5.cli",
        "quantize",
        "--model",
        str(tmp_path / "src"),
        "--format",
        "compressed-tensors",
        "--out",
        str(tmp_path / "q"),
        "--calib-seqs",
        "0",
        "--overwrite",
    ]
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    for line in child.stderr:  # one plain progress line per step when stderr is not a terminal
        if b"writing" in line:
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL
    load_quantized(tmp_path / "q")  # the previous export, or the new one: never nothing
    from glm5.core.model import GLM5ForCausalLM

    GLM5ForCausalLM.from_pretrained(tmp_path / "src", backend="reference")
    assert _q(runner, tmp_path / "src", tmp_path / "q", "--overwrite").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]  # staging of the kill removed


def test_quantize_reports_progress(tmp_path):
    tiny_model(seed=3).save_pretrained(tmp_path / "src")
    res = CliRunner().invoke(
        main,
        [
            "quantize",
            "--model",
            str(tmp_path / "src"),
            "--format",
            "compressed-tensors",
            "--out",
            str(tmp_path / "q"),
            "--calib-seqs",
            "2",
            "--calib-len",
            "24",
        ],
    )
    assert res.exit_code == 0, res.output
    for step in (
        "quantize: loading",
        "quantize: calibrating layers 3/5 (layer 2)",
        "quantize: calibrating layers 5/5 (layer 4, MTP, data-free)",
        "quantize: writing",
    ):
        assert step in res.stderr, res.stderr
