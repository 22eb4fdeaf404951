"""Bad invocations of every `glm5` command end in one line naming the argument and what was expected,
with exit code 2, never a traceback (issue 13 items 11, 15, 16); `glm5 --help` imports nothing heavy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import backends
from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM

HAS_ONNX = importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxscript") is not None


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(0)
    model.save_pretrained(root / "float")
    model.save_pretrained(root / "nomtp")
    t = load_file(root / "nomtp" / "model.safetensors")
    save_file(
        {k: v for k, v in t.items() if not k.startswith("model.layers.4.")},
        root / "nomtp" / "model.safetensors",
    )
    from quant.load import export
    from quant.quantize import quantize_model

    quantize_model(model, "glm5-w8a8")
    export(model, root / "quant", "compressed-tensors")
    (root / "run" / "checkpoints" / "step-000002").mkdir(parents=True)
    (root / "run" / "checkpoints" / "latest").symlink_to("step-000002")
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    (root / "empty").mkdir()
    (root / "int_rules.yaml").write_text("name: x\nrules: [5, 6]\n")
    return root


def _cases(d):
    f, q, run = str(d / "float"), str(d / "quant"), str(d / "run")
    return [
        (["generate", "--preset", "nope"], {}, "--preset"),
        (["generate", "--preset", "tiny", "--backend", "nope"], {}, "--backend"),
        (["generate", "--preset", "tiny"], {"GLM5_BACKEND": "refrence"}, "GLM5_BACKEND"),
        (["generate", "--preset", "tiny"], {"GLM5_VALIDATE": "bogus"}, "Error: GLM5_VALIDATE: expected"),
        (["generate", "--model", run], {}, "checkpoints/latest"),
        (["generate", "--model", str(d / "empty")], {}, "--model"),
        (["generate", "--model", str(d / "missing")], {}, "--model"),
        (["generate", "--preset", "tiny", "--prompt-ids", "a,b"], {}, "--prompt-ids"),
        (["generate", "--preset", "tiny", "--max-new-tokens", "-1"], {}, "--max-new-tokens"),
        (["generate", "--model", str(d / "nomtp"), "--mtp", "2"], {}, "--mtp"),
        (["generate"], {}, "--model or --preset"),
        (["quantize", "--model", q, "--format", "compressed-tensors", "--out", str(d / "q2")], {}, "--model"),
        (["quantize", "--model", f, "--format", "modelslim", "--out", f], {}, "--out"),
        (["quantize", "--model", f, "--out", str(d / "q3")], {}, "--format"),
        (
            [
                "quantize",
                "--model",
                f,
                "--recipe",
                str(d / "int_rules.yaml"),
                "--format",
                "compressed-tensors",
                "--out",
                str(d / "q5"),
            ],
            {},
            "--recipe",
        ),
        (
            ["quantize", "--model", f, "--format", "modelslim", "--out", str(d / "q4"), "--backend", "x"],
            {},
            "--backend",
        ),
        (
            ["export-onnx", "--model", q, "--out", str(d / "float" / "config.json")],
            {},
            "--out" if HAS_ONNX else "onnx",
        ),
        (["export-onnx", "--preset", "nope", "--out", str(d / "x.onnx")], {}, "--preset"),  # before onnx
        (["train", "--out", str(d / "new"), "--resume"], {}, "--resume"),
        (["train", "--out", str(d / "new"), "--save-every", "0"], {}, "--save-every"),
        (["train", "--out", str(d / "new"), "--config", "huge"], {}, "--config"),
        (["train", "--out", run], {}, "--out"),
        (["train", "--out", str(d / "new"), "--model", q], {}, "--model"),
        (["conformance", "--backend", "nope"], {}, "nope"),
        *(
            [(["generate", "--preset", "tiny", "--backend", "cuda"], {}, "not available")]
            if not {n: ok for n, ok, _ in backends.available()}.get("cuda")
            else []
        ),
        (["conformance", "--suite", "everything"], {}, "--suite"),
    ]


def test_every_bad_invocation_is_one_line_with_exit_code_2(dirs, monkeypatch):
    runner = CliRunner()
    for args, env, word in _cases(dirs):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        res = runner.invoke(main, args)
        for k in env:
            monkeypatch.delenv(k)
        assert res.exit_code == 2, (args, res.output, repr(res.exception))
        errors = [ln for ln in res.output.splitlines() if ln.startswith("Error") or ln.startswith("error")]
        assert len(errors) == 1 and word in errors[0], (args, res.output)
        assert "Traceback" not in res.output, (args, res.output)


def test_deprecated_checkpoint_spellings_still_work(dirs, tmp_path):
    """--model everywhere; --checkpoint / --init / the positional SRC are hidden deprecated aliases."""
    res = CliRunner().invoke(
        main,
        [
            "quantize",
            str(dirs / "float"),
            "--format",
            "compressed-tensors",
            "--recipe",
            "glm5-w8a8",
            "--out",
            str(tmp_path / "q"),
            "--calib-seqs",
            "0",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "deprecated" in res.stderr
    for cmd in ("quantize", "train", "generate", "export-onnx"):
        if cmd == "export-onnx" and not HAS_ONNX:
            continue
        help_text = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "--model" in help_text
        assert "--checkpoint" not in help_text and "--init" not in help_text, help_text


def test_help_imports_nothing_heavy_and_a_missing_extra_is_one_line():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["onnx"] = None  # as on the README's plain install
        from glm5.cli import main
        codes = []
        for args in (["--help"], [], ["export-onnx", "--out", "x.onnx"]):
            try:
                main(args)
            except SystemExit as e:
                codes.append(e.code)
        heavy = [m for m in ("torch", "onnx", "onnxscript", "triton") if sys.modules.get(m) is not None]
        print("RESULT", codes, heavy)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    result = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")][-1]
    assert result == "RESULT [0, 2, 2] ['torch']" or result == "RESULT [0, 2, 2] []", result
    assert "export-onnx" in res.stdout and "quantize" in res.stdout  # the command list
    assert "needs onnx" in res.stderr and "pip install" in res.stderr


def test_help_lists_commands_without_importing_torch():
    script = (
        "import sys\nfrom glm5.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "TORCH False" in res.stdout, res.stdout + res.stderr


def test_generate_rejects_prompt_ids_past_the_vocabulary(dirs):
    res = CliRunner().invoke(main, ["generate", "--preset", "tiny", "--prompt-ids", f"1,{10**9}"])
    assert res.exit_code == 2 and "--prompt-ids" in res.output and "vocab_size" in res.output
