"""DSA prefill on the cpu backend vs torch SDPA at GLM-5's heads, with torch's default thread count and with
one thread, on the machine as it is and under a background load this script starts itself (issue 21).

  dsa        indexer_topk (H_I=32) + sparse_mla_attention (H=64, d_qk 576, d_v 512, topk 2048) on the
             cpu backend, the last --queries queries of an --seqlen key request (chunked prefill; S > topk);
  attention  the sparse_mla_attention half of dsa alone (the indexer's share is dsa - attention);
  sdpa       dense attention over the same causal pairs, torch scaled_dot_product_attention (flash CPU
             kernel) with the same absorbed shapes (bench_attention_prefill.py's run_sdpa).

Each phase ("idle": nothing added; "loaded": --load processes spinning one core each; "loaded-torch": one
torch process of small ops on torch's default threads, whose OpenMP threads compete) times the six
(variant, threads) pairs interleaved, one call of each per round, medians of --runs rounds. Ratios are
against baselines of the same phase: default threads / one thread (above 1: default threads lose), and
sdpa / dsa (DSA's speed-up). "idle" means nothing added by this script: on a shared machine the load1
field says what else ran. `dsa_bitwise_equal_across_threads`: the DSA output at default threads equals the
one-thread output bit for bit.

    python bench/bench_dsa_threads.py [--seqlen 8192] [--queries 64] [--runs 3] [--load N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit, interleaved_s  # noqa: E402
from bench.bench_attention_prefill import SM_SCALE, _layout, inputs, run_dsa, run_indexer, run_sdpa  # noqa: E402

H, H_I, TOPK = 64, 32, 2048  # GLM-5


#: the background loads: a Python loop per core, or one torch job of small ops on torch's default threads
#: (another user's training, a test run: OpenMP threads that spin at every region's barrier, the load under
#: which default threads lost 4x)
LOADS = {
    "spin": "while True: pass",
    "torch": "import torch\na = torch.randn(192, 192)\nwhile True: (a @ a).relu_().sum()",
}


@contextmanager
def spinners(n: int, kind: str = "spin"):
    """n background processes of `kind` (LOADS) while the block runs; stopped (by their pids) after it."""
    procs = [subprocess.Popen([sys.executable, "-c", LOADS[kind]]) for _ in range(n)]
    try:
        time.sleep(1.0 if kind == "spin" else 4.0)  # let them reach the run queue (torch: past its import)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def attention(x: dict, be, idx):
    """sparse_mla_attention alone, on the indices of one indexer_topk call (dsa's second half)."""
    return be.sparse_mla_attention(x["q"], x["kv"], idx, _layout(x), SM_SCALE, 512)[0]


def on_threads(n: int, fn):
    import torch

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run


def phase(name: str, spin: int, x: dict, be, default: int, runs: int) -> dict:
    import torch

    idx = run_indexer(x, be, TOPK)
    fns = {}
    for label, n in (("default", default), ("1thread", 1)):
        fns[f"dsa_{label}"] = on_threads(n, partial(run_dsa, x, be, TOPK))
        fns[f"attention_{label}"] = on_threads(n, partial(attention, x, be, idx))
        fns[f"sdpa_{label}"] = on_threads(n, partial(run_sdpa, x))
    load0 = os.getloadavg()[0]
    t = interleaved_s(fns, runs)
    same = torch.equal(fns["dsa_default"](), fns["dsa_1thread"]())
    rec = {
        "bench": "dsa_threads",
        "phase": name,
        "spinning_processes": spin,
        "load1_at_start": round(load0, 2),
        "S": x["kv"].shape[0],
        "T": x["q"].shape[0],
        "heads": H,
        "index_heads": H_I,
        "topk": TOPK,
        "default_threads": default,
        **{f"{k}_s": round(v, 3) for k, v in t.items()},
        "dsa default/1thread": round(t["dsa_default"] / t["dsa_1thread"], 2),
        "attention default/1thread": round(t["attention_default"] / t["attention_1thread"], 2),
        "sdpa default/1thread": round(t["sdpa_default"] / t["sdpa_1thread"], 2),
        "sdpa/dsa default": round(t["sdpa_default"] / t["dsa_default"], 2),
        "sdpa/dsa 1thread": round(t["sdpa_1thread"] / t["dsa_1thread"], 2),
        "dsa_bitwise_equal_across_threads": same,
        "runs": runs,
        **cpu_context(),
    }
    rec["load1_at_end"] = rec.pop("load1")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192, help="keys S (> topk 2048)")
    ap.add_argument("--queries", type=int, default=64, help="the last T queries of the request")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--load", type=int, default=None, help="spinning processes in the loaded phase (cores)")
    ap.add_argument("--quick", action="store_true", help="S 4096, T 32, 2 runs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.seqlen, a.queries, a.runs = 4096, 32, 2
    bounds = (("--seqlen", a.seqlen, TOPK + 1), ("--queries", a.queries, 1), ("--runs", a.runs, 1))
    for name, v, low in bounds:
        if v < low:
            ap.error(f"{name}: expected an int >= {low}, got {v}")
    if a.queries > a.seqlen:
        ap.error(f"--queries: expected at most --seqlen ({a.seqlen}), got {a.queries}")
    spin = (os.cpu_count() or 1) if a.load is None else a.load
    if spin < 0:
        ap.error(f"--load: expected an int >= 0, got {spin}")
    import torch

    import backends

    be = backends.get("cpu")
    default = torch.get_num_threads()
    x = inputs(a.seqlen, H, H_I, t=a.queries)
    emit(phase("idle", 0, x, be, default, a.runs), a.json)
    with spinners(spin):
        emit(phase("loaded", spin, x, be, default, a.runs), a.json)
    with spinners(1, "torch"):
        emit(phase("loaded-torch", 1, x, be, default, a.runs), a.json)


if __name__ == "__main__":
    main()
