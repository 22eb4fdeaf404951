"""The cost ledger (glm5/deploy/ledger.py: the model on fake tensors, fake collectives, balanced routing)
against the same counts measured on a real 2-process gloo run of the tiny model (glm5/deploy/gloo_counts.py,
one launch for both layouts): TP2 + EP2 (tokens replicated) and DP2 + EP2 (experts across data-parallel
ranks), a prefill and a decode step; FLOPs by op within 5% (the issue's target), bytes per collective kind
within 5%, cache and weight bytes equal. Each rank computes its own ledger next to its measurement."""

from __future__ import annotations

import json

import pytest

from glm5.deploy import gloo_counts
from tests.ranks import run_ranks


def test_ledger_matches_a_gloo_run_of_the_tiny_model():
    results = run_ranks(gloo_counts.per_rank, 2)
    for rank, per_step in enumerate(results):
        assert set(per_step) == {(k, s) for k in gloo_counts.LAYOUTS for s in gloo_counts.STEPS}
        for (kind, step), (got, led) in per_step.items():
            msg = f"{kind} rank {rank} {step}"
            assert set(led.flops) == set(got["flops"]), msg
            assert set(led.bytes) == set(got["bytes"]), msg
            assert led.ratios()["expert_flops"] == pytest.approx(1.0, rel=0.05), msg
        for layout, step, r, what, key, ledger, measured in gloo_counts.compare(rank, per_step):
            msg = f"{layout} rank {r} {step} {what} {key}"
            if what in ("flops", "bytes"):
                assert measured > 0 and ledger == pytest.approx(measured, rel=0.05), msg
            else:  # cache and weight bytes: the same tensors on both sides
                assert ledger == measured, msg


def test_plan_prints_the_ledger_and_refuses_a_layout_it_cannot_run():
    from click.testing import CliRunner

    from glm5.cli import main

    base = ["plan", "--config", "tiny", "--machine", "h200x8", "--recipe", "bf16", "--max-model-len", "64"]
    steps = ["--ledger", "--prefill-len", "16", "--decode-batch", "2", "--decode-context", "32"]
    r = CliRunner().invoke(main, [*base, "--dp", "8", *steps, "--json"])
    assert r.exit_code == 0, r.output
    led = json.loads(r.output)["ledger"]
    assert list(led) == ["prefill 16", "decode 2 x 1 @ 32"]
    for (cost,) in led.values():  # one expert per rank, each rank its own tokens: the ideal share
        assert cost["ratios"]["expert_flops"] == pytest.approx(1.0)
        assert set(cost["collective_bytes"]) == {"all_to_all"} and cost["flops_by_op"]["glm5::grouped_matmul"]
    r = CliRunner().invoke(main, [*base, "--tp", "2", "--dp", "4", *steps])
    assert r.exit_code == 2
    assert "Invalid value for '--ledger': the ledger runs TP N or DP N + EP N, not DP4 x TP2" in r.output
