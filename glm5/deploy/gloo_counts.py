"""The cost ledger (glm5/deploy/ledger.py) against the same counts measured on a real gloo run of the tiny
model: what tests/deploy/test_ledger.py asserts and bench/bench_ledger.py prints.

    results = per_rank(rank, world)        # on each of 2 gloo ranks (torch.distributed initialised)
    rows = compare(rank, results)          # (layout, step, rank, what, key, ledger, measured)

Two layouts on the same 2 ranks: TP2 + EP2 (tokens replicated, each rank dispatching its chunk) and
DP2 + EP2 (experts across data-parallel ranks, each rank its own sequences); per layout a prefill and a
decode step. Measured: FLOPs by op (CountOps on real tensors), bytes per collective kind (Counted around
the gloo TorchGroup), cache bytes and weight bytes. The ledger's figures for the same rank and step are
computed on fake tensors in the same process (each rank its own: the ranks share the work).

The real run's router is made balanced over the two ranks by construction (no group limit, a zero gate
and a bias choosing expert 0, on rank 0, and expert E/2, on rank 1, for every token): the case the
ledger assumes.
"""

from __future__ import annotations

import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.deploy.counting import Counted, CountOps
from glm5.deploy.ledger import Layout, rank_cost, run_step

#: step -> (batch, new tokens, cached context); both longer than the tiny preset's index_topk (16), so
#: the indexer selects
STEPS = {"prefill": (1, 24, 0), "decode": (3, 1, 24)}
LAYOUTS = {"tp": Layout(tp=2), "dp": Layout(dp=2)}


def tiny_config() -> GLM5Config:
    return GLM5Config.from_preset("tiny", n_group=1, topk_group=1)


def _balanced(model: GLM5ForCausalLM) -> None:
    e = model.config.n_routed_experts
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:  # experts 0 (rank 0's) and E/2 (rank 1's) for every token
                layer.mlp.gate.weight.zero_()
                bias = torch.arange(e).eq(0) | torch.arange(e).eq(e // 2)
                layer.mlp.gate.e_score_correction_bias.copy_(bias.float())


def count_step(model: GLM5ForCausalLM, kind: str, batch: int, new: int, context: int) -> dict:
    """Split `model` (unsplit, on this process's default group) as layout `kind`, run the step, count."""
    from glm5.parallel import plan
    from glm5.parallel.group import Single, TorchGroup

    group = Counted(TorchGroup())
    if kind == "tp":
        plan.apply(model, tp=group, ep=group)
    else:
        plan.apply(model, tp=Single(), ep=group, ep_tokens="local")
    counter = CountOps()
    with counter:
        cache = run_step(model, batch, new, context)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"flops": dict(counter.flops), "bytes": dict(group.bytes), "cache": cache, "weights": weights}


def per_rank(rank: int, world: int, steps: dict | None = None) -> dict:
    """On one of `world` = 2 gloo ranks: {(layout, step): (measured dict, the ledger's RankCost)}."""
    steps = STEPS if steps is None else steps
    cfg = tiny_config()
    torch.manual_seed(0)
    out = {}
    for kind, layout in LAYOUTS.items():
        for step, (batch, new, context) in steps.items():
            model = GLM5ForCausalLM(cfg, backend="reference", dtype=torch.bfloat16)  # the ledger's dtype
            _balanced(model)
            got = count_step(model, kind, batch, new, context)
            out[kind, step] = (got, rank_cost(cfg, layout, rank, batch, new, context))
    return out


def compare(rank: int, results: dict) -> list[tuple]:
    """Rows (layout, step, rank, what, key, ledger, measured) for every figure of both sides: flops by
    op, collective bytes by kind, cache bytes, weight bytes; a key on one side only has 0 on the other."""
    rows = []
    for (kind, step), (got, led) in results.items():
        name = LAYOUTS[kind].name()
        pairs = [("flops", led.flops, got["flops"]), ("bytes", led.bytes, got["bytes"])]
        for what, a, b in pairs:
            for key in sorted(set(a) | set(b)):
                rows.append((name, step, rank, what, key, a.get(key, 0), b.get(key, 0)))
        rows.append((name, step, rank, "cache", "latent + indexer", led.cache_bytes, got["cache"]))
        rows.append((name, step, rank, "weights", "all", sum(led.weight_bytes.values()), got["weights"]))
    return rows


def ratio(ledger: float, measured: float) -> float:
    """ledger / measured (1.0 where both are 0; inf where only the ledger counts something)."""
    if measured == 0:
        return 1.0 if ledger == 0 else float("inf")
    return ledger / measured


__all__ = ["LAYOUTS", "STEPS", "compare", "count_step", "per_rank", "ratio", "tiny_config"]
