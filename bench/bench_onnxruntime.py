"""ONNX Runtime backend vs the CPU reference, per op, in the same run.

Each line is one op at one shape: median wall time of the `onnxruntime` backend (sessions warmed
up first, so build time is excluded), the reference's median, and their ratio (> 1: ONNX Runtime is
faster). Both run on the same CPU threads; figures are for comparing the two, not absolute speed.

    python bench/bench_onnxruntime.py [--runs 5] [--ops topk,indexer_topk] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import backends
from backends import SeqLayout


def _median_ms(fn: Callable[..., Any], kwargs: dict[str, Any], runs: int) -> float:
    fn(**kwargs)  # warm-up: builds and caches the ONNX Runtime session
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(**kwargs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cases(g: torch.Generator) -> dict[str, tuple[str, dict[str, Any]]]:
    """op -> (shape label, kwargs) at CPU-sized but non-trivial shapes (more keys than topk)."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t, h_i, d_i, s, topk = 64, 8, 64, 4096, 512
    paged = SeqLayout.from_lengths([t], [s], block_size=64)
    k_cache = r(s // 64, 64, d_i)
    idx = torch.randint(0, s, (t, topk), generator=g, dtype=torch.int32)
    x_q = torch.randint(-127, 128, (256, 1024), generator=g, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (512, 1024), generator=g, dtype=torch.int8)
    w4 = torch.randint(0, 256, (512, 512), generator=g, dtype=torch.uint8)
    w_e = torch.randint(-128, 128, (4, 512, 1024), generator=g, dtype=torch.int8)
    offs = torch.tensor([0, 100, 100, 180, 256], dtype=torch.int32)
    x_scale = torch.rand(256, generator=g)
    indexer = dict(q=r(t, h_i, d_i), k_cache=k_cache, weights=r(t, h_i), layout=paged)
    return {
        "topk": (f"R=64 C={s} k={topk}", dict(x=r(64, s), k=topk)),
        "indexer_logits": (f"T={t} H_I={h_i} D_I={d_i} S={s} paged", indexer),
        "indexer_topk": (f"T={t} H_I={h_i} D_I={d_i} S={s} topk={topk} paged", dict(indexer, topk=topk)),
        "sparse_mla_attention": (
            f"T={t} H=16 d_qk=576 topk={topk} paged",
            dict(
                q=r(t, 16, 576),
                kv_cache=r(s // 64, 64, 576),
                indices=idx,
                layout=paged,
                sm_scale=0.0625,
                d_v=512,
            ),
        ),
        "dynamic_quant_int8": ("M=256 K=4096", dict(x=r(256, 4096))),
        "w8a8_matmul": (
            "M=256 N=512 K=1024",
            dict(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=torch.rand(512, generator=g)),
        ),
        "w4a8_matmul": (
            "M=256 N=512 K=1024 g=128",
            dict(
                x_q=x_q, x_scale=x_scale, w_packed=w4, w_scale=torch.rand(512, 8, generator=g), group_size=128
            ),
        ),
        "grouped_matmul": (
            "E=4 M=256 N=512 K=1024 w8a8",
            dict(
                x=x_q,
                w=w_e,
                group_offsets=offs,
                x_scale=x_scale,
                w_scale=torch.rand(4, 512, generator=g),
                out_dtype=torch.bfloat16,
            ),
        ),
        "linear_cross_entropy": (
            "N=512 D=256 V=8192",
            dict(h=r(512, 256), weight=r(8192, 256), targets=torch.randint(0, 8192, (512,), generator=g)),
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    p.add_argument("--json", default=None, help="append one JSON object per result to this file")
    args = p.parse_args()
    ort_be, ref = backends.get("onnxruntime"), backends.get("reference")
    cases = _cases(torch.Generator().manual_seed(0))
    for op in args.ops.split(",") if args.ops else cases:
        label, kw = cases[op]
        calls = ort_be.kernel_calls()[op]
        t_ort = _median_ms(getattr(ort_be, op), kw, args.runs)
        assert ort_be.kernel_calls()[op] > calls, f"{op}: no ONNX Runtime session ran"
        t_ref = _median_ms(getattr(ref, op), kw, args.runs)
        row = {
            "bench": "onnxruntime",
            "op": op,
            "shape": label,
            "onnxruntime_ms": round(t_ort, 3),
            "reference_ms": round(t_ref, 3),
            "speedup_vs_reference": round(t_ref / t_ort, 3),
            "runs": args.runs,
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
