"""Ascend backend benchmarks: each op through `backends.get("ascend")` against a baseline timed in the same
run (median of --runs runs after warm-up), reported as JSON lines with ratio = baseline / ours (> 1: ours
is faster).

Baselines: for ops on a fused operator, the bare operator call (so the ratio is the price of the
adapter: layout conversion, the exact re-rank of the indexer's top-k, lse conversion); for kernels,
the plain torch_npu (aclnn) formulation of the op (torch.topk, a dequantized bf16 matmul, the
materialised logits cross-entropy).

On an Atlas A2/A3 (torch_npu + CANN + triton-ascend installed):
    python bench/ascend/bench_ascend.py [--runs 20] [--json out.jsonl] [--ops topk,indexer_topk]
Without an NPU, `--emulate` runs tiny shapes through the CPU emulations and triton-ascend's interpreter
(GLM5_ASCEND_EMULATE=1, TRITON_INTERPRET=1): that proves the script runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emulate", action="store_true", help="no NPU: tiny shapes, CPU emulations, interpreter")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--ops", default=None, help="comma-separated subset")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.emulate:
        os.environ["GLM5_ASCEND_EMULATE"] = "1"
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernels_ascend import
    a.runs = a.runs or (2 if a.emulate else 20)
    return a


def _median_ms(fn, runs: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    a = _args()
    import torch

    import backends
    from backends import SeqLayout
    from backends.ascend import indexer_topk as li
    from backends.reference.w4a8_matmul import pack_int4

    be = backends.get("ascend")
    dev = be.device
    sync = torch.npu.synchronize if dev == "npu" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    tiny = a.emulate

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    # GLM-5 shapes (one TP16 rank: 4 attention heads); --emulate shrinks the key count and batch
    s_k, t_q, topk = (300, 4, 64) if tiny else (65536, 64, 2048)
    lay = SeqLayout.from_lengths([t_q], [s_k], block_size=128).to(dev)
    nb = -(-s_k // 128)
    q_i, k_i, w_i = rand(t_q, 32, 128), rand(nb, 128, 128), rand(t_q, 32, dtype=torch.float32)
    idx = be.indexer_topk(q_i, k_i, w_i, lay, topk)
    q_a, kv = rand(t_q, 4, 576), rand(nb, 128, 576)
    m, k, n, e = (16, 64, 48, 4) if tiny else (4096, 6144, 4096, 32)
    x = rand(m, k)
    x_q, x_s = be.dynamic_quant_int8(x)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(dev)
    w_s = torch.rand(n, generator=g).to(dev)
    w4 = pack_int4(torch.randint(-8, 8, (n, k), generator=g)).to(dev)
    offs = torch.linspace(0, m, e + 1).long().to(dev)
    w_e = rand(e, n, k)
    v, d = (64, 32) if tiny else (154880, 6144)
    h, wv, tg = (
        rand(256 if not tiny else 8, d),
        rand(v, d),
        torch.randint(0, v, (256 if not tiny else 8,)).to(dev),
    )

    w_bf = rand(k, n)
    scores = rand(t_q, s_k, dtype=torch.float32)

    def raw_indexer():
        return li.call_operator(be.provider, q_i, k_i, w_i, lay, topk)

    cases = {
        "indexer_topk": (
            lambda: be.indexer_topk(q_i, k_i, w_i, lay, topk),
            raw_indexer,
            "bare npu_lightning_indexer",
        ),
        "sparse_mla_attention": (lambda: be.sparse_mla_attention(q_a, kv, idx, lay, 0.0625, 512), None, None),
        "topk": (
            lambda: be.topk(scores, 8),
            lambda: torch.topk(scores, 8),
            "torch.topk",
        ),
        "dynamic_quant_int8": (
            lambda: be.dynamic_quant_int8(x),
            lambda: x.float().abs().amax(1) / 127,
            "torch amax/127 (scale only)",
        ),
        "w8a8_matmul": (
            lambda: be.w8a8_matmul(x_q, x_s, w_q, w_s),
            lambda: x @ w_bf,
            "bf16 torch matmul",
        ),
        "w4a8_matmul": (
            lambda: be.w4a8_matmul(x_q, x_s, w4, w_s[:, None], k),
            lambda: x @ w_bf,
            "bf16 torch matmul",
        ),
        "grouped_matmul": (
            lambda: be.grouped_matmul(x, w_e, offs),
            lambda: [x[offs[i] : offs[i + 1]] @ w_e[i].T for i in range(e)],
            "per-expert torch matmul",
        ),
        "linear_cross_entropy": (
            lambda: be.linear_cross_entropy(h, wv, tg),
            lambda: torch.nn.functional.cross_entropy((h @ wv.T).float(), tg),
            "materialised logits + torch cross_entropy",
        ),
    }
    want = a.ops.split(",") if a.ops else list(cases)
    for op in want:
        ours, base, what = cases[op]
        rec = {
            "bench": f"ascend/{op}",
            "device": be.environment().get("device", "cpu (emulation, figures meaningless)"),
            "runs": a.runs,
            "ours_ms": _median_ms(ours, a.runs, sync),
        }
        if base is not None:
            rec |= {"baseline": what, "baseline_ms": _median_ms(base, a.runs, sync)}
            rec["ratio"] = rec["baseline_ms"] / rec["ours_ms"]
        rec["routes"] = sorted({r for (o, r) in be.provider.routes if o == op})
        line = json.dumps(rec)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a", encoding="utf-8") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
