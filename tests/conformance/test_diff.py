"""`glm5 conformance --backend A --backend B --diff`: two backends compared with each other on shared inputs.
A backend that ranks top-k candidates on fp16-rounded values swaps near-tied keys; the diff names them."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import backends
from backends import Backend, OpCaps, OpImpl, registry
from conformance import cases
from conformance import diff as cdiff
from conformance.cli import conformance
from tests.conformance.fakes import quant_half_away, quant_own

NEAR_TIES = "adversarial/near_ties_low_bits*"


def _topk(x, k, lengths, key_of):
    r, c = x.shape
    cand = (
        torch.ones(r, c, dtype=torch.bool)
        if lengths is None
        else torch.arange(c)[None, :] < lengths.long()[:, None]
    )
    key = torch.where(cand, key_of(x), float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    taken = cand.gather(1, order)
    values = torch.where(taken, x.gather(1, order), torch.tensor(float("-inf"), dtype=x.dtype))
    return values, torch.where(taken, order, -1).to(torch.int32)


def topk_exact(x, k, lengths=None):
    return _topk(x, k, lengths, lambda t: t.float())


def topk_fp16_keys(x, k, lengths=None):
    """Ranks on values rounded to fp16: near-ties in fp32 become ties, broken by the lower index."""
    return _topk(x, k, lengths, lambda t: t.half().float())


class Exact(Backend):
    name = "fake_exact"
    ops = {
        "topk": OpImpl(topk_exact, OpCaps(("float32",), tie_rule="lower_index")),
        "dynamic_quant_int8": OpImpl(quant_own, OpCaps(("float32",))),
    }


class ExactToo(Exact):
    name = "fake_exact_too"


class Rounded(Backend):
    name = "fake_rounded"
    ops = {
        "topk": OpImpl(topk_fp16_keys, OpCaps(("float32",), tie_rule="lower_index")),
        "dynamic_quant_int8": OpImpl(quant_half_away, OpCaps(("float32",))),
    }


def _near_ties():
    sel = cases.select(["topk"], "adversarial", NEAR_TIES, ["float32"])
    assert sel
    return sel


def test_near_tie_swaps_are_named_with_their_scores():
    diffs = cdiff.run(Exact(), Rounded(), _near_ties())
    d = diffs[0]
    assert d.status == "differs", d.message
    idx = next(o for o in d.outputs if o.output == "indices")
    assert idx.verdict == "differs" and idx.swaps
    swap = next(s for s in idx.swaps if s["kind"] == "different positions")
    # the swapped keys are near-ties: their scores agree to fp16 precision, not bitwise
    assert swap["only_a"] and swap["only_b"]
    assert 0 < swap["relative_gap"] < 2**-10
    x = d.outputs and _near_ties()[0][0].inputs("float32")["x"]
    row = swap["row"]
    assert all(float(x[row, p]) == v for p, v in swap["only_a"].items())
    text = cdiff.swap_text(swap, "fake_exact", "fake_rounded")
    assert text.startswith(f"row {row}: only fake_exact ") and "only fake_rounded" in text


def test_same_implementation_is_identical_and_integer_outputs_differ():
    assert {d.status for d in cdiff.run(Exact(), ExactToo(), _near_ties())} == {"identical"}
    sel = cases.select(["dynamic_quant_int8"], "adversarial", "adversarial/round_half_even*", ["float32"])
    d = cdiff.run(Exact(), Rounded(), sel)[0]
    xq = next(o for o in d.outputs if o.output == "x_q")
    assert d.status == "differs" and xq.verdict == "differs" and xq.metrics["max_abs"] == 1


def test_declined_cases_are_not_compared():
    sel = cases.select(["topk"], "smoke", None, ["bfloat16"])
    diffs = cdiff.run(Exact(), Rounded(), sel)
    assert diffs and {d.status for d in diffs} == {"declined"}
    assert cdiff.exit_code(diffs) == 1  # nothing was compared


def test_cli_diff(monkeypatch, tmp_path):
    for cls in (Exact, Rounded):
        monkeypatch.setitem(registry.BUILTIN, cls.name, f"{__name__}:{cls.__name__}")
    backends.refresh()
    try:
        out = CliRunner().invoke(
            conformance,
            [
                "--backend",
                "fake_exact,fake_rounded",
                "--diff",
                "--ops",
                "topk",
                "--suite",
                "adversarial",
                "--case",
                NEAR_TIES,
                "--dtype",
                "float32",
                "--json",
                str(tmp_path / "d.json"),
            ],
        )
        assert out.exit_code == 1, out.output
        assert "DIFFERS fake_exact vs fake_rounded topk/float32/adversarial/near_ties_low_bits" in out.output
        assert "only fake_exact" in out.output and "score gap" in out.output
        data = json.loads((tmp_path / "d.json").read_text())
        assert data["backends"] == ["fake_exact", "fake_rounded"] and data["summary"]["topk"]["differs"] >= 1
        bad = CliRunner().invoke(conformance, ["--backend", "fake_exact", "--diff", "--ops", "topk"])
        assert bad.exit_code == 2 and "expected exactly two" in bad.output
        assert len(bad.output.strip().splitlines()) == 1
    finally:
        backends.refresh()


def test_manifest_skips_are_not_compared(tmp_path, monkeypatch):
    (tmp_path / "expectations.yaml").write_text(
        'expectations:\n  - match: "topk/float32/adversarial/near_ties*"\n'
        '    status: skip\n    reason: "keys rounded to fp16 on purpose"\n'
    )
    monkeypatch.setattr(Rounded, "expectations_path", lambda self: tmp_path / "expectations.yaml")
    diffs = cdiff.run(Exact(), Rounded(), _near_ties())
    assert [d.status for d in diffs] == ["skipped"]
    assert "fake_rounded manifest skips it: keys rounded to fp16 on purpose" in diffs[0].message
    assert cdiff.exit_code(diffs) == 1  # nothing was compared


def test_diff_bad_input_goes_to_stderr_and_its_json_is_replaced_atomically(tmp_path, monkeypatch):

    from glm5.cli import main
    from glm5.infra import fsio

    res = CliRunner().invoke(main, ["conformance", "--diff", "--backend", "cpu"])
    assert res.exit_code == 2 and "exactly two" in res.stderr and "exactly two" not in res.stdout
    written = []
    real = fsio.write_text_atomic
    monkeypatch.setattr(fsio, "write_text_atomic", lambda p, t: (written.append(p), real(p, t)))
    out = tmp_path / "d.json"
    res = CliRunner().invoke(
        main,
        [
            "conformance",
            "--diff",
            "--backend",
            "cpu,reference",
            "--ops",
            "topk",
            "--suite",
            "smoke",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert [str(p) for p in written] == [str(out)] and json.loads(out.read_text())["backends"]
