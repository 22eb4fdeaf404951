"""The cost ledger (glm5/deploy/ledger.py: the model on fake tensors, fake collectives, balanced routing)
against the same counts measured on a real 2-process gloo run of the tiny model: TP2 + EP2 (tokens
replicated) and DP2 + EP2 (experts across data-parallel ranks), a prefill and a decode step; FLOPs by op
within 5% (the issue's target), bytes per collective kind within 5%, cache and weight bytes equal.

The real run's router is made balanced over the two ranks by construction (no group limit, a zero gate
and a bias choosing one expert on each rank), the case the ledger assumes."""

from __future__ import annotations

import json

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.deploy.counting import Counted, CountOps
from glm5.deploy.ledger import Layout, rank_cost, run_step
from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup
from tests.ranks import run_ranks

STEPS = {"prefill": (1, 40, 0), "decode": (3, 1, 50)}  # batch, new tokens, cached context


def _config() -> GLM5Config:
    return GLM5Config.from_preset("tiny", n_group=1, topk_group=1)


def _measure(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cfg = _config()
    out = {}
    for (kind, step), (batch, new, context) in [((k, s), v) for k in ("tp", "dp") for s, v in STEPS.items()]:
        model = GLM5ForCausalLM(cfg, backend="reference", dtype=torch.bfloat16)  # the ledger's dtype
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.is_moe:  # experts 0 (rank 0's) and 4 (rank 1's) for every token
                    layer.mlp.gate.weight.zero_()
                    layer.mlp.gate.e_score_correction_bias.copy_(
                        torch.arange(8.0).eq(0) + torch.arange(8.0).eq(4)
                    )
        group = Counted(TorchGroup())
        if kind == "tp":
            plan.apply(model, tp=group, ep=group)
        else:
            plan.apply(model, tp=Single(), ep=group, ep_tokens="local")
        counter = CountOps()
        with counter:
            cache = run_step(model, batch, new, context)
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        out[kind, step] = (dict(counter.flops), dict(group.bytes), cache, weights)
    return out


def test_ledger_matches_a_gloo_run_of_the_tiny_model():
    measured = run_ranks(_measure, 2)
    for (kind, step), rank in [(key, r) for key in measured[0] for r in range(2)]:
        layout = Layout(tp=2) if kind == "tp" else Layout(dp=2)
        batch, new, context = STEPS[step]
        flops, sent, cache, weights = measured[rank][kind, step]
        led = rank_cost(_config(), layout, rank, batch, new, context)
        msg = f"{kind} rank {rank} {step}"
        assert set(led.flops) == set(flops), msg
        for op, n in flops.items():
            assert led.flops[op] == pytest.approx(n, rel=0.05), f"{msg}: {op}"
        assert set(led.bytes) == set(sent), msg
        for k, n in sent.items():
            assert led.bytes[k] == pytest.approx(n, rel=0.05), f"{msg}: {k}"
        assert led.cache_bytes == cache, msg
        assert sum(led.weight_bytes.values()) == weights, msg
        assert led.ratios()["expert_flops"] == pytest.approx(1.0, rel=0.05), msg


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
