"""Peak extra memory of the reference `indexer_topk` against the dense [T, S] fp32 logits (SPEC 2.2).

SPEC 2.2 asks for peak extra memory O(T*topk + chunk), never the [T, S] logits. Each run happens in a
fresh subprocess: it builds the inputs, resets the kernel's peak-RSS mark (/proc/self/clear_refs "5";
falls back to ru_maxrss where that is not writable), calls the op, and reports peak RSS minus the
RSS after the inputs were built. The figure includes the int32 [T, topk] output itself.

    .venv/bin/python bench/mem_indexer_topk.py                      # T=S=16384, H_I=32, D_I=128, topk=2048
    .venv/bin/python bench/mem_indexer_topk.py --runs 1 --t 4096 --s 4096 --baseline

`--baseline` also measures `indexer_topk_naive` (materialises [T, S]) in the same run, for the ratio.
Exit status 1 if the chunked op's peak extra reaches `--max-fraction` of the dense matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(t: int, s: int, heads: int, dim: int, topk: int, naive: bool, seed: int) -> dict:
    """One measurement: one request with T queries over S keys (right-down causal)."""
    import torch

    import backends
    from backends.reference.indexer_topk import indexer_topk, indexer_topk_naive

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, dim, generator=gen)  # [T, H_I, D_I] fp32
    k_cache = torch.randn(s, dim, generator=gen)  # ragged [S, D_I]
    weights = torch.randn(t, heads, generator=gen) * (heads * dim) ** -0.5
    layout = backends.SeqLayout.from_lengths([t], [s])
    layout.check(t, k_cache, "k_cache")
    fn = indexer_topk_naive if naive else indexer_topk
    hwm_reset = _reset_peak()
    base_kib = _status_kib("VmRSS") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = fn(q, k_cache, weights, layout, topk)
    seconds = time.perf_counter() - t0
    peak_kib = _status_kib("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert out.shape == (t, topk)
    return dict(
        peak_extra=(peak_kib - base_kib) * 1024,
        seconds=seconds,
        hwm_reset=hwm_reset,
        threads=torch.get_num_threads(),
    )


def measure(args: argparse.Namespace, naive: bool) -> list[dict]:
    runs = []
    for i in range(args.runs):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--t",
            str(args.t),
            "--s",
            str(args.s),
            "--heads",
            str(args.heads),
            "--dim",
            str(args.dim),
            "--topk",
            str(args.topk),
            "--seed",
            str(i),
        ]
        cmd += ["--naive"] if naive else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"child failed ({' '.join(cmd)}):\n{proc.stderr}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def report(name: str, runs: list[dict], dense: int) -> float:
    peak = statistics.median(r["peak_extra"] for r in runs)
    secs = statistics.median(r["seconds"] for r in runs)
    each = ", ".join(f"{r['peak_extra'] / MiB:.0f}" for r in runs)
    print(
        f"{name:<22} peak extra {peak / MiB:8.1f} MiB (median of {len(runs)}: {each})  "
        f"= {peak / dense:6.3f} x dense   time {secs:7.2f} s (median)"
    )
    return peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--s", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true", help="also measure indexer_topk_naive")
    p.add_argument("--max-fraction", type=float, default=0.5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.t, a.s, a.heads, a.dim, a.topk, a.naive, a.seed)))
        return 0
    dense = a.t * a.s * 4
    print(
        f"indexer_topk reference: T={a.t} S={a.s} H_I={a.heads} D_I={a.dim} topk={a.topk} fp32, "
        f"one request; dense [T, S] fp32 = {dense / MiB:.0f} MiB; output [T, topk] int32 = "
        f"{a.t * a.topk * 4 / MiB:.0f} MiB; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    peak = report("indexer_topk (chunked)", measure(a, naive=False), dense)
    print(f"load average after the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall clock)")
    if a.baseline:
        naive = report("indexer_topk_naive", measure(a, naive=True), dense)
        print(f"chunked / naive peak extra: {peak / naive:.3f}")
    ok = peak < a.max_fraction * dense
    print(("OK" if ok else "FAIL") + f": peak extra {'<' if ok else '>='} {a.max_fraction} x dense")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
