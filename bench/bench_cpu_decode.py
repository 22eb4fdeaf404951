"""Decode throughput on CPU (issue 14): a batch of --batch requests at --context tokens of context, the
small-width GLM-5 of bench_cpu_model.py, cpu backend vs reference in the same process, interleaved.

The caches are filled with random latent and indexer-key rows (the cost of a decode step does not
depend on what the context says, and a 16K prefill per request would dominate the run), then each
round times --steps decode steps of every backend (greedy, one token per request per step) and rewinds
the caches. Reported: tokens/s (batch * steps / time, median round), and the share of a step spent
outside the backend's ops (the model's own torch code: projections, norms, RoPE, routing, sampling),
from timing every `Backend._call` during the steps.

    OMP_NUM_THREADS=2 python bench/bench_cpu_decode.py [--batch 8] [--context 16384] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit  # noqa: E402
from bench.bench_cpu_model import small_config  # noqa: E402


def _timed_calls(be) -> Counter:
    """Wrap the backend instance's dispatch so every op call adds its wall time to the returned Counter."""
    spent: Counter = Counter()
    inner = be._call

    def timed(op, args):
        t0 = time.perf_counter()
        try:
            return inner(op, args)
        finally:
            spent[op] += time.perf_counter() - t0

    be._call = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", default="cpu,reference")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import backends
    from glm5.core.model import GLM5ForCausalLM

    cfg = small_config(a.context + a.steps + 1)
    runs = {}
    for name in a.backends.split(","):
        be = backends.get(name)
        model = GLM5ForCausalLM(cfg, backend=be).eval()  # the same seeded weights for every backend
        cache = model.new_cache(a.batch, a.context + a.steps + 1)
        g = torch.Generator().manual_seed(0)  # the same context for every backend
        for t in cache.kv + [t for t in cache.index_k if t is not None]:
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        runs[name] = {"model": model, "cache": cache, "spent": _timed_calls(be), "times": [], "ops": []}
    first = torch.randint(0, cfg.vocab_size, (a.batch,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for rnd in range(a.rounds + 1):  # round 0 warms up
            for r in runs.values():
                cache = r["cache"]
                cache.lengths = [a.context] * a.batch
                nxt, spent0 = first, sum(r["spent"].values())
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    nxt = model_step(r["model"], cache, nxt)
                dt = time.perf_counter() - t0
                if rnd:
                    r["times"].append(dt)
                    r["ops"].append(sum(r["spent"].values()) - spent0)
                r["tokens"] = nxt.tolist()
    ctx = cpu_context()
    base = runs.get("reference")
    for name, r in runs.items():
        med = statistics.median(r["times"])
        i = r["times"].index(med)
        rec = {
            "bench": "cpu_decode",
            "backend": name,
            "batch": a.batch,
            "context": a.context,
            "steps": a.steps,
            "rounds": a.rounds,
            "tokens_per_s": round(a.batch * a.steps / med, 2),
            "step_ms": round(med / a.steps * 1e3, 2),
            "share_outside_ops": round(1 - r["ops"][i] / med, 3),
            "last_tokens": r["tokens"],
            **ctx,
        }
        if base is not None:
            rec["speedup_vs_reference"] = round(statistics.median(base["times"]) / med, 3)
        emit(rec, a.json)


def model_step(model, cache, nxt):
    return model(nxt[:, None], cache).logits[:, -1].argmax(-1)


if __name__ == "__main__":
    main()
