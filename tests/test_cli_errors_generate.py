"""Bad invocations of `glm5 generate` / `export-onnx` (and a preset too large for `train`) end in one line
naming the argument, with exit code 2, before anything large is allocated or run (issue 21); `--version`,
the deprecated `generate --checkpoint` and `export-onnx --help` without the onnx extra work."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import backends
from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM

HAS_ONNX = importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxscript") is not None
HAS_ORT = {n: ok for n, ok, _ in backends.available()}.get("onnxruntime", False)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-gen")
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(0)
    model.save_pretrained(root / "float")
    res = CliRunner().invoke(
        main,
        [
            "quantize",
            "--model",
            str(root / "float"),
            "--format",
            "fp8",
            "--out",
            str(root / "fp8"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    return root


def _cases(d):
    tiny = ["generate", "--preset", "tiny"]
    limit = GLM5Config.from_preset("tiny").max_position_embeddings
    return [
        # a preset that cannot fit in this machine's memory: refused before it is built
        (["generate", "--preset", "glm5-744b"], "--preset", "GiB"),
        (["train", "--config", "glm5-744b", "--out", str(d / "run744")], "--config", "GiB"),
        (
            ["export-onnx", "--preset", "glm5-744b", "--out", str(d / "x.onnx")],
            "--preset" if HAS_ONNX else "onnx",
            "GiB" if HAS_ONNX else "pip install",
        ),
        # positions past max_position_embeddings
        ([*tiny, "--prompt-len", str(limit + 1)], "--prompt-len", "max_position_embeddings"),
        ([*tiny, "--prompt-len", "1000000"], "--prompt-len", "max_position_embeddings"),
        ([*tiny, "--max-new-tokens", str(limit)], "--max-new-tokens", "max_position_embeddings"),
        (
            [*tiny, "--prompt-ids", "1,2", "--max-new-tokens", str(limit - 1)],
            "--max-new-tokens",
            "max_position_embeddings",
        ),
        ([*tiny, "--max-new-tokens", "0"], "--max-new-tokens", "1"),
        (
            ["export-onnx", "--preset", "tiny", "--seq-len", str(limit + 1), "--out", str(d / "y.onnx")],
            "--seq-len" if HAS_ONNX else "onnx",
            "max_position_embeddings" if HAS_ONNX else "pip install",
        ),
        # the draft length and the temperature
        ([*tiny, "--mtp", "1000"], "--mtp", "8"),
        ([*tiny, "--temperature", "nan"], "--temperature", "finite"),
        ([*tiny, "--temperature", "inf"], "--temperature", "finite"),
        ([*tiny, "--temperature", "-1"], "--temperature", "0"),
        *(
            [
                (
                    [
                        "generate",
                        "--model",
                        str(d / "fp8"),
                        "--backend",
                        "onnxruntime",
                        "--max-new-tokens",
                        "2",
                    ],
                    "--backend",
                    "onnxruntime",
                )
            ]
            if HAS_ORT
            else []
        ),
    ]


def test_every_bad_invocation_is_one_line_with_exit_code_2(dirs):
    runner = CliRunner()
    for args, hint, word in _cases(dirs):
        res = runner.invoke(main, args)
        assert res.exit_code == 2, (args, res.output, repr(res.exception))
        errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
        assert len(errors) == 1 and hint in errors[0] and word in errors[0], (args, res.output)
        assert "Traceback" not in res.output, (args, res.output)


def test_the_largest_accepted_values_still_run():
    limit = GLM5Config.from_preset("tiny").max_position_embeddings
    res = CliRunner().invoke(
        main,
        [
            "generate",
            "--preset",
            "tiny",
            "--prompt-len",
            str(limit - 2),
            "--max-new-tokens",
            "2",
            "--mtp",
            "8",
            "--temperature",
            "0.5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert '"tokens": [' in res.output


def test_version_is_the_installed_package_version():
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"glm5 {importlib.metadata.version('glm5-backends')}"


def test_generate_accepts_the_deprecated_checkpoint_spelling(dirs):
    res = CliRunner().invoke(
        main, ["generate", "--checkpoint", str(dirs / "float"), "--max-new-tokens", "2", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert "deprecated" in res.stderr and '"tokens": [' in res.stdout


def test_export_onnx_help_works_without_the_onnx_extra():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["onnx"] = None  # as on the README's plain install
        sys.modules["onnxscript"] = None
        from glm5.cli import main
        try:
            main(["export-onnx", "--help"])
        except SystemExit as e:
            print("EXIT", e.code)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert "EXIT 0" in res.stdout and "--seq-len" in res.stdout, res.stdout + res.stderr


@pytest.mark.skipif(not HAS_ONNX, reason="needs the onnx extra")
def test_export_onnx_quiet_prints_nothing_on_stderr(tmp_path):
    """The exporters' warnings (torch.onnx registration, onnx_ir attribute types, FutureWarnings) are
    silenced under --quiet; the result line stays on stdout."""
    script = "from glm5.cli import main; main()"
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "export-onnx",
            "--preset",
            "tiny",
            "--seq-len",
            "8",
            "--no-verify",
            "--quiet",
            "--out",
            str(tmp_path / "m.onnx"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", res.stderr
    assert re.match(r"wrote .*m\.onnx: opset \d+", res.stdout), res.stdout


def test_nothing_cites_a_reference_outside_the_repository():
    cited = "shared/" + "reference"  # spelled apart so that this file does not cite it
    dirs = [
        "docs",
        "glm5",
        "backends",
        "quant",
        "conformance",
        "bench",
        "tests",
        *(p.name for p in ROOT.glob("kernels_*")),
    ]
    paths = [
        ROOT / "README.md",
        *(
            p
            for d in dirs
            for p in (ROOT / d).rglob("*")
            if p.suffix in {".md", ".py", ".yaml", ".tmpl", ".txt"}
        ),
    ]
    assert [str(p) for p in paths if cited in p.read_text(errors="replace")] == []
