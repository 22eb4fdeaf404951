"""cpu backend's deterministic top-k against `torch.topk` (and the reference) in the same run (issue 14).

Target: at least 0.9 of torch.topk's speed at 2048 of 128K columns, bitwise equal to the reference.
Rounds interleave the variants; medians of --runs rounds. bf16 rows are reported too: most of them tie
across the k-th value (bf16 has 8 significant bits), which sends them to the exact cut-tie path.

    OMP_NUM_THREADS=2 python bench/bench_cpu_topk.py [--runs 5] [--rows 64] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit, interleaved_s  # noqa: E402

SHAPES = [(131072, 2048, "float32"), (16384, 2048, "float32"), (131072, 2048, "bfloat16")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import backends

    cpu, ref = backends.get("cpu"), backends.get("reference")
    g = torch.Generator().manual_seed(0)
    for c, k, dt in SHAPES:
        x = torch.randn(a.rows, c, generator=g).to(getattr(torch, dt))
        t = interleaved_s(
            {
                "cpu": partial(cpu.topk, x, k),
                "torch.topk": partial(torch.topk, x, k, dim=1, sorted=True),
                "reference": partial(ref.topk, x, k),
            },
            a.runs,
        )
        got, want = cpu.topk(x, k), ref.topk(x, k)
        rec = {
            "bench": "cpu_topk",
            "rows": a.rows,
            "columns": c,
            "k": k,
            "dtype": dt,
            "cpu_ms": round(t["cpu"] * 1e3, 2),
            "torch.topk_ms": round(t["torch.topk"] * 1e3, 2),
            "reference_ms": round(t["reference"] * 1e3, 2),
            "ratio torch.topk/cpu": round(t["torch.topk"] / t["cpu"], 3),
            "ratio torch.topk/reference": round(t["torch.topk"] / t["reference"], 3),
            "bitwise_equal_reference": torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]),
            "runs": a.runs,
            **cpu_context(),
        }
        emit(rec, a.json)


if __name__ == "__main__":
    main()
