"""Borrowing (SPEC 3.1): a declared op runs the reference on host copies, counted; nothing else borrows;
conformance says BORROWED, never PASS; the worked example (examples/port) generates end to end."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import backends
from backends import registry
from backends.borrow import every_op_except
from backends.contract.ops import OP_NAMES
from backends.counters import REFERENCE_CALLS
from backends.errors import NotSupported
from backends.interface import Backend
from conformance import cases
from conformance.report import BackendRun, cell, summary
from conformance.result import BORROWED, PASS, UNSUPPORTED
from conformance.runner import Runner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "port"


class Borrows(Backend):
    """Ports nothing; borrows topk and indexer_logits."""

    name = "borrows"
    borrow = frozenset({"topk", "indexer_logits"})


def _smoke_args(op: str) -> dict:
    case, dtype = cases.select([op], "smoke", dtypes=["float32"])[0]
    return case.inputs(dtype)


def test_a_borrowed_op_is_the_reference_on_host_copies_and_counted():
    be, ref = Borrows(), backends.get("reference")
    x = torch.randn(4, 9)
    lengths = torch.tensor([9, 3, 0, 5], dtype=torch.int32)
    before = REFERENCE_CALLS["topk"]
    vals, idx = be.topk(x, 3, lengths)
    want_v, want_i = ref.topk(x, 3, lengths)
    assert torch.equal(vals, want_v) and torch.equal(idx, want_i)
    assert REFERENCE_CALLS["topk"] == before + 2  # the borrowed call and ref.topk: the reference ran
    cost = be.borrow_ledger.cost("topk")
    assert cost["calls"] == 1
    assert cost["bytes_to_host"] == x.numel() * 4 + lengths.numel() * 4
    assert cost["bytes_to_device"] == vals.numel() * 4 + idx.numel() * 4
    assert cost["seconds"] > 0
    assert be.calls["topk"] == 1 and sum(be.kernel_calls().values()) == 0  # the reference's work, not ours


def test_an_op_neither_ported_nor_borrowed_still_declines():
    with pytest.raises(NotSupported, match="not implemented by backend 'borrows'"):
        Borrows().dynamic_quant_int8(torch.randn(2, 8))
    assert Backend().borrowed == frozenset()  # nothing borrows unless declared


def test_borrowed_layout_op_and_its_gradients():
    be, ref = Borrows(), backends.get("reference")
    args = _smoke_args("indexer_logits")
    q1 = args["q"].clone().requires_grad_()
    q2 = args["q"].clone().requires_grad_()
    got = be.indexer_logits(**{**args, "q": q1})
    want = ref.indexer_logits(**{**args, "q": q2})
    assert torch.equal(got, want)
    finite = want.isfinite()
    got[finite].sum().backward()
    want[finite].sum().backward()
    assert torch.equal(q1.grad, q2.grad)
    layout = args["layout"]
    layout_bytes = sum(t.numel() * t.element_size() for t in layout.tensors() if t is not None)
    tensors = sum(args[n].numel() * args[n].element_size() for n in ("q", "k_cache", "weights"))
    # the forward and the declared backward each copy the inputs, layout included; the backward also the
    # output gradient (no forward runs again)
    cost = be.borrow_ledger.cost("indexer_logits")
    assert cost["bytes_to_host"] == 2 * (tensors + layout_bytes) + got.numel() * 4
    assert cost["calls"] == 2 and be.calls["indexer_logits"] == 1


def test_the_declaration_is_checked():
    class Typo(Backend):
        name = "typo"
        borrow = frozenset({"topk", "top_k"})

    with pytest.raises(TypeError, match="'top_k' is not an op of the contract"):
        Typo()
    with pytest.raises(TypeError, match="expected a set of op names"):
        every_op_except("topk", "grouped_matmul") and type("S", (Backend,), {"borrow": "topk"})()
    with pytest.raises(TypeError, match="'nope' is not an op"):
        every_op_except("nope")
    assert every_op_except("topk") == frozenset(OP_NAMES) - {"topk"}


def test_conformance_reports_borrowed_never_passing():
    be = Borrows()
    results = Runner(be).run(cases.select(["topk", "dynamic_quant_int8"], "smoke", dtypes=["float32"]))
    by_op = {op: {r.status for r in results if r.op == op} for op in ("topk", "dynamic_quant_int8")}
    assert by_op == {"topk": {BORROWED}, "dynamic_quant_int8": {UNSUPPORTED}}
    assert not any(r.status == PASS for r in results)
    assert be.borrow_ledger.calls["topk"] == 0  # nothing to compare: the reference against itself
    run = BackendRun("borrows", {}, results)
    assert cell([r for r in results if r.op == "topk"]) == "borrowed"
    s = summary([run])["borrows"]
    assert s[BORROWED] == sum(r.op == "topk" for r in results) and s["ok"] is False  # computed nothing


@pytest.fixture
def dayone(monkeypatch):
    """The worked example as an installed plugin: its entry point, its directory on sys.path."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    ep = metadata.EntryPoint("dayone", "glm5_dayone:DayoneBackend", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_plugin_entry_points", lambda: [ep])
    backends.refresh()
    yield backends.get("dayone")
    backends.refresh()


def test_worked_example_generates_end_to_end(dayone):
    from glm5.cli import main

    out = CliRunner().invoke(
        main, ["generate", "--preset", "tiny", "--backend", "dayone", "--max-new-tokens", "3", "--json"]
    )
    assert out.exit_code == 0, out.output
    ref = CliRunner().invoke(
        main, ["generate", "--preset", "tiny", "--backend", "reference", "--max-new-tokens", "3", "--json"]
    )
    tokens = [json.loads(r.output.strip().splitlines()[-1])["tokens"] for r in (out, ref)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
    assert dayone.calls["grouped_matmul"] > 0  # its own op ran
    borrowed = dayone.borrow_ledger.snapshot()
    assert {"indexer_topk", "sparse_mla_attention"} <= set(borrowed)
    assert "grouped_matmul" not in borrowed


def test_port_status_shows_borrowed_rows_and_their_cost(dayone, tmp_path):
    from conformance import report
    from glm5.port import status

    # the report from a conformance JSON of two ops (cheap), plus the model-level checks it runs itself
    runner = Runner(dayone)
    results = runner.run(cases.select(["topk", "grouped_matmul"], "smoke", dtypes=["float32"]))
    report.write_json([BackendRun("dayone", {}, results)], str(tmp_path / "c.json"))
    rep = status.build("dayone", need=status.Need(), from_json=str(tmp_path / "c.json"))
    rows = {(r["op"], r["dtype"]): r["state"] for r in rep["rows"]}
    assert rows[("topk", "float32")] == "borrowed" and rows[("grouped_matmul", "float32")] == "passing"
    assert rep["states"]["borrowed"] == 1 and rep["rows_passing"] == 1
    assert rep["model_checks"]["greedy_tokens"]["status"] == "pass"
    cost = {b["op"]: b["cost"] for b in rep["borrowed"]}
    assert set(cost) == set(dayone.borrowed)
    assert cost["sparse_mla_attention"]["calls"] > 0 and cost["sparse_mla_attention"]["bytes_to_host"] > 0
    assert cost["w8a8_matmul"]["calls"] == 0  # a float model borrows no int8 GEMM
    needed_borrowed = [x for x in rep["remaining"] if x["what"].startswith("sparse_mla_attention/")]
    assert needed_borrowed and "borrowed from the reference" in needed_borrowed[0]["why"]
    md = status.to_markdown(rep)
    assert "## Borrowed ops" in md and "| topk | float32 | borrowed |" in md
    assert "1 borrowed" in status.headline(rep)


def test_a_split_pool_cache_travels_as_itself():
    from backends.borrow import HOST, _move
    from backends.cache_layout import MLAPools

    pools = MLAPools(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 2))
    moved, n = _move((pools, torch.zeros(3)), HOST)
    assert type(moved[0]) is MLAPools and n == (64 + 16 + 3) * 4
