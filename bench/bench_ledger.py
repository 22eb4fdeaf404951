"""The per-rank cost ledger (`glm5 plan --ledger`, glm5/deploy/ledger.py) against the counts measured on a
real gloo run of the tiny model: ledger / measured per rank, per op and per collective, and the largest
deviation against the issue's target (within 5%).

    python bench/bench_ledger.py [--prefill 24] [--decode-batch 3] [--context 24] [--json PATH]

On 2 gloo processes on 127.0.0.1 (one thread each, reference backend, bf16), both layouts the ledger runs
at 2 ranks: TP2 + EP2 (tokens replicated, each rank dispatching its chunk) and DP2 + EP2 (experts across
data-parallel ranks); per layout a prefill of --prefill tokens and one decode step of --decode-batch
sequences at --context cached tokens. The measuring code is glm5/deploy/gloo_counts.py (the test
tests/deploy/test_ledger.py asserts the same rows): the router is balanced over the ranks by
construction, the ledger's assumption. Rows: FLOPs by op (torch's FlopCounter formulas and the custom
ops' own, CountOps), bytes this rank puts on the wire per collective kind (at the algorithm's cost:
Counted), cache bytes (latent + indexer, + MTP) and weight bytes. The figures are counts, not timings: a
run gives the same numbers on any machine; the load average is printed for the seconds the run took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import gloo_ranks  # noqa: E402

TARGET = 0.05


def _rank(rank: int, world: int, port: int, steps: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from glm5.deploy import gloo_counts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        queue.put((rank, gloo_counts.compare(rank, gloo_counts.per_rank(rank, world, steps))))
    finally:
        dist.destroy_process_group()


def measure(steps: dict, world: int = 2) -> list[tuple]:
    """Every rank's rows (layout, step, rank, what, key, ledger, measured)."""
    return [row for rows in gloo_ranks(_rank, world, steps) for row in rows]


def _fmt(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3f}{unit}"
    return f"{x:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=24, help="prefill tokens (one sequence)")
    ap.add_argument("--decode-batch", type=int, default=3)
    ap.add_argument("--context", type=int, default=24, help="cached tokens of each decode sequence")
    ap.add_argument("--json", default=None, help="append one JSON object per row to this file")
    args = ap.parse_args()
    for name, value in (("--prefill", args.prefill), ("--decode-batch", args.decode_batch)):
        if value < 1:
            ap.error(f"{name}: at least 1, got {value}")
    if args.context < 0:
        ap.error(f"--context: at least 0, got {args.context}")
    from glm5.deploy.gloo_counts import ratio

    steps = {"prefill": (1, args.prefill, 0), "decode": (args.decode_batch, 1, args.context)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = measure(steps)
    took = time.perf_counter() - t0
    print(
        f"ledger / measured, tiny model on 2 gloo ranks (load {load:.1f} on {os.cpu_count()} cpus, "
        f"{took:.1f} s): prefill {args.prefill}, decode {args.decode_batch} x 1 @ {args.context}"
    )
    head = ("layout", "step", "rank", "what", "key", "ledger", "measured")
    print("  {:13} {:8} {:>4}  {:8} {:36} {:>10} {:>10}  ratio".format(*head))
    worst = (0.0, None)
    for layout, step, rank, what, key, ledger, measured in rows:
        r = ratio(ledger, measured)
        if abs(r - 1) >= worst[0]:
            worst = (abs(r - 1), (layout, step, rank, what, key))
        print(
            f"  {layout:13} {step:8} {rank:>4}  {what:8} {key:36} {_fmt(ledger):>10} {_fmt(measured):>10}"
            f"  {r:.4f}"
        )
        if args.json:
            with open(args.json, "a") as f:
                row = dict(zip(head, (layout, step, rank, what, key, ledger, measured), strict=True))
                f.write(json.dumps({**row, "ratio": r, "load_1min": load}) + "\n")
    dev, where = worst
    verdict = "within" if dev <= TARGET else "OUTSIDE"
    print(f"max |ledger / measured - 1| = {dev:.4f} ({' '.join(map(str, where))}): {verdict} the 5% target")


if __name__ == "__main__":
    main()
