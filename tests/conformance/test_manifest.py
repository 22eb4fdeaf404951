"""Expectations manifests: reasons required, strict xfail, skips, tolerance overrides, unused entries."""

from __future__ import annotations

import pytest
import yaml

import backends
from conformance import cases
from conformance.manifest import ManifestError, load, parse
from conformance.result import FAIL, PASS, SKIPPED, XFAIL, XPASS
from conformance.runner import Runner
from tests.conformance import fakes


def test_missing_reason_is_an_error():
    with pytest.raises(ManifestError, match="reason: required"):
        parse({"expectations": [{"match": "topk/*", "status": "xfail"}]})
    with pytest.raises(ManifestError, match="reason: required"):
        parse({"tolerances": [{"match": "topk/*", "atol": 1e-3, "reason": "  "}]})


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"expectations": [{"match": "x", "status": "maybe", "reason": "r"}]}, "status"),
        ({"expectations": [{"match": "x", "status": "xfail", "reason": "r", "typo": 1}]}, "unknown keys"),
        ({"tolerances": [{"match": "x", "reason": "r"}]}, "at least one"),
        ({"tolerances": [{"match": "x", "atol": -1, "reason": "r"}]}, "non-negative"),
        ({"tolerances": [{"match": "x", "atol": float("nan"), "reason": "r"}]}, "finite"),
        ({"tolerances": [{"match": "x", "rtol": float("inf"), "reason": "r"}]}, "finite"),
        ({"xfails": []}, "unknown top-level"),
    ],
)
def test_malformed_entries(data, msg):
    with pytest.raises(ManifestError, match=msg):
        parse(data)


def test_files_are_read_with_safe_load(tmp_path):
    p = tmp_path / "expectations.yaml"
    p.write_text("expectations:\n  - {match: 'topk/*', status: skip, reason: !!python/name:os.system ''}\n")
    with pytest.raises(yaml.YAMLError):
        load(p)
    assert load(tmp_path / "missing.yaml").entries == []


def test_nan_tolerance_in_a_yaml_file_is_refused(tmp_path):
    p = tmp_path / "expectations.yaml"
    p.write_text("tolerances:\n  - {match: 'topk/*', atol: .nan, reason: 'loosen'}\n")
    with pytest.raises(ManifestError, match="atol: expected a finite"):
        load(p)


def test_reference_manifest_is_valid_and_empty():
    m = load(backends.get("reference").expectations_path())
    assert m.path.endswith("backends/reference/expectations.yaml") and m.entries == []


def _run(backend, manifest, **sel):
    runner = Runner(backend, manifest=parse(manifest))
    return runner, {(r.case, r.dtype): r for r in runner.run(cases.select(**sel))}


def test_strict_xfail_turns_a_pass_into_xpass():
    m = {
        "expectations": [
            {"match": "topk/float32/smoke/random*", "status": "xfail", "reason": "r"},
            {"match": "topk/float32/smoke/never*", "status": "xfail", "reason": "stale"},
        ]
    }
    runner, res = _run(backends.get("reference"), m, ops=["topk"], suite="smoke", dtypes=["float32"])
    assert res[("smoke/random_r4_c16_k5", "float32")].status == XPASS
    assert res[("smoke/lengths_r5_c12_k8", "float32")].status == PASS
    assert [e.match for e in runner.manifest.unused()] == ["topk/float32/smoke/never*"]


def test_xfail_on_a_failure_skip_and_when():
    m = {
        "expectations": [
            {
                "match": "dynamic_quant_int8/float32/adversarial/round_half*",
                "status": "xfail",
                "reason": "known",
            },
            {
                "match": "dynamic_quant_int8/bfloat16/adversarial/round_half*",
                "status": "skip",
                "reason": "slow",
            },
            {
                "match": "dynamic_quant_int8/*/adversarial/zero*",
                "status": "skip",
                "reason": "r",
                "when": {"torch": "0.0"},
            },
        ]
    }
    _, res = _run(fakes.WrongRounding(), m, ops=["dynamic_quant_int8"], suite="adversarial")
    assert res[("adversarial/round_half_even_ties", "float32")].status == XFAIL
    assert res[("adversarial/round_half_even_ties", "bfloat16")].status == SKIPPED
    assert res[("adversarial/zero_and_tiny_rows", "float32")].status != SKIPPED  # `when` did not match


def test_tolerance_override_loosens_only_what_it_names():
    sel = dict(ops=["grouped_matmul"], suite="smoke", dtypes=["float32"])
    m = {
        "tolerances": [
            {"match": "grouped_matmul/float32/*", "output": "out", "rtol": 0, "atol": 0, "reason": "r"}
        ]
    }
    _, res = _run(fakes.Nondeterministic(), m, **sel)
    r = res[("smoke/e4_m10_k32_n16_one_empty", "float32")]
    assert r.status == FAIL and "out:" in r.message  # tightened to exact: the jitter now shows
