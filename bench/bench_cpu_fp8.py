"""cpu backend's FP8 ops (SPEC 7) against the reference backend in the same run (issue 16).

One realistic GLM-5 shape per op (decode-time indexer and attention at 16K keys, a 64-token projection),
rounds interleaving cpu and reference, medians of --runs rounds; each line says whether the cpu result
is bitwise the reference's (or its largest difference, for the ops with a tolerance).

    OMP_NUM_THREADS=2 python bench/bench_cpu_fp8.py [--runs 3] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit, interleaved_s  # noqa: E402


def _cases(g):
    import torch

    from conformance.cases._fp8 import activations, indexer_inputs, mla_cache, weights
    from conformance.cases.sparse_mla_attention import GLM5_SM_SCALE, causal_indices

    x = torch.randn(64, 6144, generator=g).bfloat16()
    yield "fp8_quant_group", "M64 K6144 bf16 ue8m0", (x, 128, 1e-4, True)
    x_q, x_s = activations(g, 64, 6144, ue8m0=True)
    w_q, w_s = weights(g, 2048, 6144)
    yield "fp8_block_matmul", "M64 K6144 N2048", (x_q, x_s, w_q, w_s, None, torch.bfloat16)
    ew_q, ew_s = weights(g, 8, 512, 6144)
    offs = torch.arange(0, 65, 8, dtype=torch.int32)
    yield "fp8_grouped_matmul", "E8 x 8 rows K6144 N512", (x_q, x_s, ew_q, ew_s, offs, torch.bfloat16)
    a = indexer_inputs(g, [1, 1], [16384, 16384], h_i=32, d_i=128, block_size=64)
    args = (a["q"], a["k_cache"], a["k_scale"], a["weights"], a["layout"])
    yield "fp8_indexer_logits", "decode T2 H_I32 S16K paged", args
    yield "fp8_indexer_topk", "decode T2 H_I32 S16K top2048", (*args, 2048)
    kv = (torch.randn(2048, 576, generator=g) / 10).clamp(-1, 1).bfloat16()
    yield "fp8_mla_cache_quant", "N2048 (a prefill chunk)", (kv,)
    layout, cache = mla_cache(g, [1, 1], [16384, 16384], block_size=64)
    q = torch.randn(2, 64, 576, generator=g).clamp(-1, 1).bfloat16()
    idx = causal_indices(g, [1, 1], [16384, 16384], 2048)
    yield (
        "fp8_sparse_mla_attention",
        "decode T2 H64 top2048 of 16K",
        (q, cache, idx, layout, GLM5_SM_SCALE, 512),
    )


def _compare(got, want):
    import torch

    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    bitwise = all(
        torch.equal(a.view(torch.uint8).reshape(-1), b.view(torch.uint8).reshape(-1))
        if a.dtype.itemsize == 1
        else torch.equal(a, b)
        for a, b in zip(got, want)
    )
    worst = 0.0
    for a, b in zip(got, want):
        if a.dtype.is_floating_point and a.dtype.itemsize > 1:
            fin = torch.isfinite(b)
            if bool(fin.any()):
                worst = max(worst, float((a.double()[fin] - b.double()[fin]).abs().max()))
    return bitwise, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import backends

    cpu, ref = backends.get("cpu"), backends.get("reference")
    g = torch.Generator().manual_seed(0)
    for op, shape, args in _cases(g):
        t = interleaved_s(
            {"cpu": partial(getattr(cpu, op), *args), "reference": partial(getattr(ref, op), *args)}, a.runs
        )
        bitwise, worst = _compare(getattr(cpu, op)(*args), getattr(ref, op)(*args))
        rec = {
            "bench": "cpu_fp8",
            "op": op,
            "shape": shape,
            "cpu_ms": round(t["cpu"] * 1e3, 2),
            "reference_ms": round(t["reference"] * 1e3, 2),
            "ratio reference/cpu": round(t["reference"] / t["cpu"], 2),
            "bitwise_equal_reference": bitwise,
            "max_abs_diff": worst,
            "runs": a.runs,
            **cpu_context(),
        }
        emit(rec, a.json)


if __name__ == "__main__":
    main()
