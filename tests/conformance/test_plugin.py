"""A deliberately wrong out-of-tree backend, installed as a real plugin (entry point group
`glm5.backends`), must fail `glm5 conformance` with readable repro lines and a flagged fallback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

import backends

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "glm5-wrongplug"
version = "0.0.1"

[project.entry-points."glm5.backends"]
wrongplug = "wrongplug:WrongBackend"

[tool.setuptools]
packages = ["wrongplug"]
"""

PLUGIN = '''
"""Wrong on purpose: topk breaks ties by the higher index, dynamic_quant_int8 rounds half away from
zero, w8a8_matmul quietly calls the reference."""
import torch

from backends import Backend, OpCaps, OpImpl
from backends.reference.w8a8_matmul import w8a8_matmul as reference_w8a8


def topk(x, k, lengths=None):
    r, c = x.shape
    cand = torch.ones(r, c, dtype=torch.bool) if lengths is None else \\
        torch.arange(c)[None, :] < lengths.long()[:, None]
    key = torch.where(cand, x.float(), float("-inf")).flip(1)      # reversed: stable sort prefers high index
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    idx = c - 1 - order
    taken = cand.gather(1, idx)
    values = torch.where(taken, x.gather(1, idx), torch.tensor(float("-inf"), dtype=x.dtype))
    indices = torch.where(taken, idx, -1).to(torch.int32)
    if k > c:
        indices = torch.cat([indices, indices.new_full((r, k - c), -1)], 1)
        values = torch.cat([values, values.new_full((r, k - c), float("-inf"))], 1)
    return values, indices


def dynamic_quant_int8(x):
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    y = xf / scale[:, None]
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


def w8a8_matmul(**kw):
    return reference_w8a8(**kw)


class WrongBackend(Backend):
    name = "wrongplug"
    ops = {
        "topk": OpImpl(topk, OpCaps(("float32", "float16"), tie_rule="lower_index")),
        "dynamic_quant_int8": OpImpl(dynamic_quant_int8, OpCaps(("float32", "bfloat16"))),
        "w8a8_matmul": OpImpl(w8a8_matmul, OpCaps(("float32",))),
    }
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrongplug")
    pkg = root / "src"
    (pkg / "wrongplug").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (pkg / "wrongplug" / "__init__.py").write_text(PLUGIN)
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(pkg),
        ],
        check=True,
    )
    return site


def test_wrong_plugin_fails_with_repro_and_flags_fallback(plugin_site, monkeypatch):
    from conformance.cli import conformance

    monkeypatch.syspath_prepend(str(plugin_site))
    backends.refresh()
    try:
        assert ("wrongplug", True) in [(n, ok) for n, ok, _ in backends.available()]
        out = CliRunner().invoke(
            conformance,
            ["--backend", "wrongplug", "--ops", "topk,dynamic_quant_int8,w8a8_matmul", "--suite", "quick"],
        )
    finally:
        backends.refresh()
    text = out.output
    assert out.exit_code == 1, text
    # ties broken by the higher index: named case, worst elements and a repro line that reruns it
    assert "FAIL wrongplug topk/float32/adversarial/ties_constant_rows" in text
    assert (
        "repro: glm5 conformance --backend wrongplug --ops topk --suite full --case "
        "adversarial/ties_constant_rows --dtype float32" in text
    )
    assert "worst elements of indices" in text
    # round half away from zero
    assert "FAIL wrongplug dynamic_quant_int8/bfloat16/adversarial/round_half_even_ties" in text
    # the reference called from inside the backend
    assert "fallback: the reference implementation ran" in text
    assert "w8a8_matmul/float32/smoke/m4_k32_n8_bias" in text
    # unclaimed dtypes are unsupported, not failures
    assert "unsupported" in text


def test_wrong_plugin_from_a_fresh_process(plugin_site, tmp_path):
    import json
    import os

    env = dict(os.environ, PYTHONPATH=str(plugin_site))
    report = tmp_path / "wrong.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm5.cli",
            "conformance",
            "--backend",
            "wrongplug",
            "--ops",
            "topk",
            "--case",
            "adversarial/ties*",
            "--json",
            str(report),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    failed = {(r["dtype"], r["case"]) for r in results if r["status"] == "FAIL"}
    assert ("float32", "adversarial/ties_constant_rows") in failed
    assert all(r["repro"].startswith("glm5 conformance --backend wrongplug --ops topk") for r in results)
