"""`glm5 ops [NAME]`: where an op lives, derived from the op table and the registry (issue 22 item 6)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

import backends
from backends import registry
from backends.contract.ops import OPS
from glm5.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "port"


def _lines(output: str) -> dict[str, str]:
    """'  what   where' lines of `glm5 ops NAME` as {what: where}."""
    out = {}
    for line in output.splitlines()[1:]:
        what, _, text = line.strip().partition("  ")
        out[what] = text.strip()
    return out


@pytest.fixture
def with_dayone(monkeypatch):
    """The worked example (examples/port) as a plugin: one op ported, the others borrowed."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    ep = metadata.EntryPoint("dayone", "glm5_dayone:DayoneBackend", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_plugin_entry_points", lambda: [ep])
    backends.refresh()
    yield
    backends.refresh()


def test_without_name_every_op_is_listed():
    out = CliRunner().invoke(main, ["ops"])
    assert out.exit_code == 0, out.output
    assert [line.split()[0] for line in out.output.splitlines()] == list(OPS)
    assert "SPEC 2.3" in next(line for line in out.output.splitlines() if line.startswith("topk "))


def test_where_topk_lives(with_dayone):
    out = CliRunner().invoke(main, ["ops", "topk"])
    assert out.exit_code == 0, out.output
    rows = _lines(out.output)
    assert out.output.splitlines()[0] == "topk"
    assert rows["spec"].startswith("docs/spec.md 2.3 `topk(")
    declared = rows["declaration"]
    assert declared.startswith("backends/reference/topk.py:") and declared.endswith(" topk")
    assert rows["interface"].startswith("backends/contract/typed_ops.py:")
    assert rows["interface"].endswith("ContractOps.topk")
    # through the counting decorator, to the function's own file
    assert rows["reference"].startswith("backends/reference/topk.py:") and rows["reference"].endswith(" topk")
    assert rows["backend cpu"].startswith("backends/cpu/topk.py:")
    assert rows["backend dayone"] == "borrowed (the reference on host copies)"
    assert rows["cases"] == "conformance/cases/topk.py"
    tests = rows["tests (by file name)"]
    assert "tests/backends/reference/test_topk.py" in tests and "test_indexer_topk" not in tests
    assert "bench/bench_topk.py" in rows["bench (by file name)"]


def test_a_ported_op_of_a_plugin_names_its_file(with_dayone):
    out = CliRunner().invoke(main, ["ops", "grouped_matmul"])
    assert out.exit_code == 0, out.output
    assert _lines(out.output)["backend dayone"].startswith("examples/port/glm5_dayone/grouped_matmul.py:")


def test_unknown_op_is_one_line_listing_the_known_ones():
    out = CliRunner().invoke(main, ["ops", "top_k"])
    assert out.exit_code == 2 and (out.exception is None or isinstance(out.exception, SystemExit))
    errors = [line for line in out.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'NAME'" in errors[0] and "unknown op 'top_k'" in errors[0]
    assert all(op in errors[0] for op in OPS)
    assert "Traceback" not in out.output


def test_a_backends_limits_and_notes_are_shown():
    """Typed limits and free-text notes are read by `glm5 ops` (before, OpCaps.notes reached no output)."""
    out = CliRunner().invoke(main, ["ops", "grouped_matmul"])
    assert out.exit_code == 0, out.output
    caps = registry.loaded("cpu").ops["grouped_matmul"].caps
    row = _lines(out.output)["backend cpu"]
    assert caps.notes and all(f"{k}: {v}" in row for k, v in caps.notes.items())
