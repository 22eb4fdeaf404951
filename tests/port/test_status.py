"""`glm5 port status`: row states from conformance results, the ops GLM-5 needs derived from the model code,
what remains, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conformance.report import BackendRun
from conformance.result import FAIL, PASS, SKIPPED, UNSUPPORTED, XFAIL, Result
from glm5.port import status
from glm5.port.cli import port
from glm5.port.needs import derive


def _r(case: str, st: str, msg: str = "") -> Result:
    return Result("topk", "x", "float32", case, st, message=msg, repro=f"repro {case}")


@pytest.mark.parametrize(
    ("results", "state"),
    [
        ([_r("smoke/a", PASS), _r("errors/e", PASS)], "passing"),
        ([_r("smoke/a", PASS), _r("smoke/b", UNSUPPORTED, "heads > 64")], "partial"),
        ([_r("smoke/a", PASS), _r("smoke/b", XFAIL, "known")], "partial"),
        ([_r("smoke/a", PASS), _r("errors/e", FAIL, "wrong message")], "failing"),
        ([_r("smoke/a", UNSUPPORTED, "not ported yet"), _r("errors/e", PASS)], "unsupported"),
        ([_r("smoke/a", SKIPPED, "manifest")], "skipped"),
        ([_r("smoke/a", SKIPPED, "manifest"), _r("smoke/b", UNSUPPORTED, "no")], "unsupported"),
        ([_r("smoke/a", XFAIL, "known")], "failing"),
        ([], "not run"),
    ],
)
def test_row_states(results, state):
    row = status.row("topk", "float32", results)
    assert row["state"] == state
    assert sum(row["counts"].values()) == len(results)


def test_row_reasons_and_counts_apart_from_validation():
    rs = [_r("smoke/a", UNSUPPORTED, "not ported yet"), _r("smoke/b", UNSUPPORTED, "not ported yet")]
    rs.append(_r("errors/e", PASS))
    row = status.row("topk", "float32", rs)
    assert row["reasons"] == ["not ported yet (x2)"]
    assert row["numeric"] == {"total": 2, "passed": 0} and row["validation"] == {"total": 1, "passed": 1}
    assert row["cell"] == "unsupported"  # the conformance matrix's cell, verbatim: errors/ cases do not count
    bad = status.row("topk", "float32", [_r("smoke/a", FAIL, "indices differ")])
    assert bad["reasons"] == ["indices differ"] and bad["repro"] == ["repro smoke/a"]


def test_rows_cover_the_whole_matrix():
    from backends.contract.ops import OPS

    table = status.rows(BackendRun("x", {}, [_r("smoke/a", PASS)]))
    assert len(table) == sum(len(s.dtype_axis) for s in OPS.values())
    assert [r["state"] for r in table if r["op"] == "topk" and r["dtype"] == "float32"] == ["passing"]
    assert {r["state"] for r in table} == {"passing", "not run"}


def test_needs_follow_the_config_and_the_recipe():
    base, info = derive("tiny")
    keys = {(n.op, n.dtype) for n in base}
    assert {
        ("indexer_topk", "float32"),
        ("sparse_mla_attention", "float32"),
        ("grouped_matmul", "float32"),
    } <= keys
    assert not {op for op, _ in keys} & {"w8a8_matmul", "dynamic_quant_int8", "linear_cross_entropy"}
    assert {"paged", "ragged"} <= next(n for n in base if n.op == "sparse_mla_attention").layouts
    assert "generate MTP speculative" in info["ran"]
    quant = {(n.op, n.dtype) for n in derive("tiny", ("glm5-w8a8",))[0]}
    assert {
        ("w8a8_matmul", "float32"),
        ("dynamic_quant_int8", "float32"),
        ("grouped_matmul", "w8a8"),
    } <= quant
    big, info = derive("glm5-744b")
    assert info["dtype"] == "bfloat16"
    assert ("sparse_mla_attention", "bfloat16") in {(n.op, n.dtype) for n in big}
    trained = {n.op: n for n in derive("tiny", train=True)[0]}
    assert trained["linear_cross_entropy"].backward and trained["sparse_mla_attention"].backward
    assert not trained["topk"].backward  # integer selections carry no gradient


def test_remaining_names_missing_rows_layouts_and_backward():
    from backends import OpCaps, OpImpl
    from backends.interface import Backend
    from glm5.port.needs import Needed

    class Half(Backend):
        name = "half"
        ops = {"sparse_mla_attention": OpImpl(lambda **kw: None, OpCaps(("float32",), ("ragged",)))}

    table = [status.row("sparse_mla_attention", "float32", [_r("smoke/a", PASS)])]
    need = [Needed("sparse_mla_attention", "float32", {"ragged", "paged"}, backward=True)]
    model = {
        "greedy_tokens": {"status": "pass", "detail": ""},
        "shadow": {"status": "fail", "detail": "topk"},
    }
    rem = status.remaining(Half(), table, need, model)
    assert rem[0]["what"] == "sparse_mla_attention/float32"
    assert "['paged'] not claimed" in rem[0]["why"] and "backward needed" in rem[0]["why"]
    assert rem[1] == {"what": "model check shadow", "why": "fail: topk"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["status", "no_such_backend"], "unknown backend 'no_such_backend'"),
        (["status", "reference", "--config", "no_such_preset"], "--config"),
        (["status", "reference", "--recipe", "no_such_recipe", "--no-model"], "--recipe"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    out = CliRunner().invoke(port, args)
    assert out.exit_code == 2, out.output
    assert says in out.output and len(out.output.strip().splitlines()) == 1, out.output


def test_reference_report_matches_its_conformance_json(tmp_path):
    rep_path, conf_path = tmp_path / "status.json", tmp_path / "conf.json"
    out = CliRunner().invoke(
        port,
        ["status", "reference", "--suite", "smoke", "--no-model", "--json", str(rep_path)]
        + ["--conformance-json", str(conf_path)],
    )
    assert out.exit_code == 0, out.output
    rep, conf = json.loads(rep_path.read_text()), json.loads(conf_path.read_text())
    by: dict = {}
    for r in conf["results"]:
        c = by.setdefault((r["op"], r["dtype"]), {})
        c[r["status"]] = c.get(r["status"], 0) + 1
    assert {(r["op"], r["dtype"]): r["counts"] for r in rep["rows"] if r["counts"]} == by
    assert rep["conformance_summary"] == conf["summary"]["reference"]
    cells = {(r["op"], r["dtype"]): r["reference"] for r in conf["coverage"]}
    assert all(cells[(r["op"], r["dtype"])] == r["cell"] for r in rep["rows"])
    assert rep["model_checks"]["greedy_tokens"]["status"] == "skipped"
    # the same report from the saved conformance JSON, without running the suite again
    again = tmp_path / "again.json"
    out = CliRunner().invoke(
        port, ["status", "reference", "--from-json", str(conf_path), "--no-model", "--json", str(again)]
    )
    assert out.exit_code == 0, out.output
    rep2 = json.loads(again.read_text())
    assert rep2["rows"] == rep["rows"] and rep2["determinism"] == rep["determinism"]
    bad = CliRunner().invoke(port, ["status", "cpu", "--from-json", str(conf_path), "--no-model"])
    assert bad.exit_code == 2 and "no results of backend 'cpu'" in bad.output


def test_needs_record_the_cache_kind_a_call_was_given():
    """A model run with FP8 caches needs the FP8 kinds (SPEC 7.9), which `port status` then looks for in
    the backend's caps."""
    from backends import SeqLayout
    from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant
    from glm5.port.needs import Recorder

    rec = Recorder()
    q, rows = torch.randn(2, 2, 576).bfloat16(), fp8_mla_cache_quant(torch.randn(4, 576) / 10)
    idx = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    rec.sparse_mla_attention(q, rows, idx, SeqLayout.from_lengths([2], [4]), 0.1, 512)
    assert rec.seen[("sparse_mla_attention", "bfloat16")].layouts == {"fp8_ragged"}
