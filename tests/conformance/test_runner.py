"""The runner: the reference passes; wrong backends are caught in the way they are wrong."""

from __future__ import annotations

import zlib

import pytest

import backends
from backends.contract.ops import OPS
from conformance import cases
from conformance.case import SUITES
from conformance.result import FAIL, PASS, UNSUPPORTED
from conformance.runner import Runner
from tests.conformance import fakes


def by_case(results):
    return {(r.case, r.dtype): r for r in results}


def test_every_op_has_every_suite_and_unique_ids():
    for op in OPS:
        cs = cases.cases(op)
        # limits/ cases are generated per backend from its declared bounds (test_limit_cases_*)
        assert {c.suite for c in cs} == set(SUITES) - {"limits"}, op
        for c in cs:
            assert c.op == op
            assert cases.dtypes_of(c), f"{op}/{c.id} has no dtype of the axis"


def test_inputs_are_seeded_by_op_and_case_id():
    c = cases.cases("topk")[0]
    assert c.seed == zlib.crc32(f"topk/{c.id}".encode())
    a, b = c.inputs("float32"), c.inputs("float32")
    assert a["x"].equal(b["x"])


def test_reference_passes_smoke_and_its_kernels_run():
    runner = Runner(backends.get("reference"))
    results = runner.run(cases.select(suite="smoke"))
    assert {r.op for r in results} == set(OPS)
    bad = [f"{r.op}/{r.dtype}/{r.case}: {r.message}" for r in results if r.status != PASS]
    assert not bad, bad
    assert all(r.kernel_calls > 0 for r in results)
    assert "--case smoke/" in results[0].repro and "--backend reference" in results[0].repro


def test_fallback_to_the_reference_fails():
    res = Runner(fakes.Fallback()).run(cases.select(["topk"], "smoke", dtypes=["float32"]))
    assert res and all(r.status == FAIL and "fallback" in r.message for r in res)


def test_writing_to_inputs_fails():
    res = Runner(fakes.MutatesInput()).run(cases.select(["dynamic_quant_int8"], "smoke", dtypes=["float32"]))
    assert res and all(r.status == FAIL and "modified its inputs" in r.message for r in res)


def test_no_kernel_calls_fails():
    res = Runner(fakes.NoKernel()).run(cases.select(["dynamic_quant_int8"], "smoke", dtypes=["float32"]))
    assert res and all(r.status == FAIL and "did not rise" in r.message for r in res)


def test_unclaimed_dtype_is_unsupported_and_the_claim_is_checked_both_ways():
    runner = Runner(fakes.QuantOnlyFloat32())
    res = by_case(runner.run(cases.select(["dynamic_quant_int8"], "quick")))
    assert res[("smoke/random_m4_k32", "float32")].status == PASS
    assert res[("smoke/random_m4_k32", "bfloat16")].status == UNSUPPORTED
    verdicts = {c["dtype"]: c["verdict"] for c in runner.claims()}
    assert verdicts["float32"] == "ok"
    assert verdicts["bfloat16"].startswith("not claimed, but the implementation passes")


def test_unclaimed_dtype_that_returns_fails():
    res = Runner(fakes.IgnoresClaims()).run(cases.select(["dynamic_quant_int8"], "smoke", dtypes=["float16"]))
    assert res and all(r.status == FAIL and "must raise NotSupported" in r.message for r in res)


def test_claimed_dtype_that_fails_is_reported_with_worst_elements_and_repro():
    runner = Runner(fakes.WrongRounding())
    res = by_case(runner.run(cases.select(["dynamic_quant_int8"], "adversarial", "adversarial/round_half*")))
    r = res[("adversarial/round_half_even_ties", "bfloat16")]
    assert r.status == FAIL and "x_q" in r.message
    worst = [c for c in r.checks if c.output == "x_q"][0].worst
    assert worst and {"index", "actual", "expected", "allowed"} <= set(worst[0])
    assert r.repro.endswith("--case adversarial/round_half_even_ties --dtype bfloat16")
    assert {c["verdict"] for c in runner.claims() if c["dtype"] in ("float32", "bfloat16")} == {
        "claimed, but failing"
    }


def test_false_determinism_claims_fail():
    runner = Runner(fakes.Nondeterministic())
    res = by_case(runner.run(cases.select(["grouped_matmul"], "smoke", "smoke/e4*", dtypes=["float32"])))
    r = res[("smoke/e4_m10_k32_n16_one_empty", "float32")]
    assert r.status == FAIL
    assert "run_to_run" in r.message and "batch_invariant" in r.message
    assert [c for c in r.checks if c.output == "out"][0].ok  # numerically it is fine
    assert runner.determinism["grouped_matmul"]["run_to_run"]["fail"] == 1


def test_error_cases_need_the_named_argument():
    res = Runner(backends.get("reference")).run(cases.select(suite="errors"))
    assert len({r.op for r in res}) == len(OPS)
    assert all(r.status == PASS and r.message.startswith("raised ValueError") for r in res), [
        r.message for r in res if r.status != PASS
    ]


@pytest.mark.parametrize("op", ["indexer_logits", "sparse_mla_attention", "linear_cross_entropy"])
def test_gradients_are_compared(op):
    runner = Runner(backends.get("reference"))
    case = next(c for c in cases.cases(op) if c.suite == "smoke" and c.grad_args)
    res = runner.run_case(case, "float32")
    assert res.status == PASS
    assert {f"grad:{n}" for n in case.grad_args} <= set(res.metrics)


def test_limit_cases_at_the_bound_pass_and_past_it_are_declined():
    """A backend declaring `k <= 40` for topk gets a case at k=40 (claimed, compared with the reference)
    and one at k=41 (must raise NotSupported); one that lies about its bound fails."""
    import backends
    from backends.caps import OpCaps, OpImpl
    from backends.contract.limits import Limit
    from backends.contract.ops import FLOATS
    from backends.reference.topk import topk as ref_topk

    bound = (Limit("k", max=40, reason="test"),)

    class Bounded(backends.Backend):
        name = "bounded"
        ops = {"topk": OpImpl(ref_topk.__wrapped__, OpCaps(FLOATS, limits=bound, tie_rule="lower_index"))}

    sel = cases.for_backend(Bounded(), ["topk"], "limits", dtypes=["float32"])
    assert sorted(c.id for c, _ in sel) == ["limits/k_at_40", "limits/k_past_41"]
    res = {r.case: r.status for r in Runner(Bounded()).run(sel)}
    assert res == {"limits/k_at_40": "PASS", "limits/k_past_41": "UNSUPPORTED"}

    class Overclaims(Bounded):  # declares k <= 40 but cannot do 40
        name = "overclaims"
        ops = {
            "topk": OpImpl(
                lambda x, k, lengths=None: ref_topk.__wrapped__(x, min(k, 39), lengths),
                Bounded.ops["topk"].caps,
            )
        }

    res = {r.case: r.status for r in Runner(Overclaims()).run(sel)}
    assert res["limits/k_at_40"] == "FAIL"


def test_a_backend_that_computes_nothing_is_not_ok():
    """errors/ cases pass on any backend (the shared front door validates), so they never make a stub
    backend look ported: every computing case unsupported -> 'unsupported' cells and a failing exit."""
    import backends
    from backends.caps import OpCaps, OpImpl
    from backends.contract.ops import FLOATS
    from conformance.report import BackendRun, cell, exit_code

    class Stub(backends.Backend):
        name = "stub"
        ops = {
            "topk": OpImpl(
                lambda x, k, lengths=None: None,
                OpCaps(FLOATS, tie_rule="lower_index", check=lambda a: ["not ported yet"]),
            )
        }

    runner = Runner(Stub())
    results = runner.run(cases.select(["topk"], "full", dtypes=["float32"]))
    assert any(r.case.startswith("errors/") and r.status == "PASS" for r in results)
    assert cell(results) == "unsupported"
    run = BackendRun("stub", runner.env, results, runner.claims(), runner.determinism, [], None)
    assert exit_code([run]) == 1
