"""Fused lightning indexer + deterministic top-k (cuda backend) against the unfused torch pipeline and the
bf16 GEMM peak, all measured in the same run.

GLM-5 indexer: H_I=32, D_I=128, topk=2048, one request of S keys whose last T queries are scored (chunked
prefill: query i sees S - T + i + 1 keys). FLOPs = 2 * H_I * D_I * sum(causal keys) (the weighted head sum
is not counted). Baselines: (a) torch: per query chunk, bf16 matmul -> relu -> head-weighted sum ->
causal mask -> torch.topk (materialises [chunk, S] logits); (b) a square bf16 torch.matmul for the
device's practical peak; the issue's target is >= 50% of it. Median of --runs runs after warm-up.

    python bench/bench_indexer_topk.py [--runs 10] [--json out.jsonl]
    python bench/bench_indexer_topk.py --tiny   # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(1024, 32768), (4096, 65536)]  # (T queries, S keys), bf16, H_I=32, D_I=128, topk=2048
TINY = [(4, 300)]  # float16, H_I=4, D_I=32, topk=32


def torch_pipeline(q, keys, w, topk, chunk=256):
    import torch

    t, h_i, d_i = q.shape
    s = keys.shape[0]
    out = []
    for a in range(0, t, chunk):
        z = min(a + chunk, t)
        dots = torch.relu(q[a:z].reshape(-1, d_i) @ keys.T).view(z - a, h_i, s).float()
        logits = torch.einsum("ths,th->ts", dots, w[a:z])
        vis = s - t + torch.arange(a, z, device=q.device) + 1
        logits.masked_fill_(torch.arange(s, device=q.device)[None, :] >= vis[:, None], float("-inf"))
        out.append(torch.topk(logits, min(topk, s), dim=1).indices)
    return torch.cat(out)


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import torch

    import backends
    from backends import SeqLayout

    cuda = backends.get("cuda")
    gen = torch.Generator(device=args.device).manual_seed(0)
    h_i, d_i, topk, dtype = (4, 32, 32, torch.float16) if args.tiny else (32, 128, 2048, torch.bfloat16)
    for t, s in TINY if args.tiny else SHAPES:
        q = torch.randn(t, h_i, d_i, generator=gen, device=args.device).to(dtype)
        keys = torch.randn(s, d_i, generator=gen, device=args.device).to(dtype)
        w = torch.randn(t, h_i, generator=gen, device=args.device) * (h_i * d_i) ** -0.5
        layout = SeqLayout.from_lengths([t], [s], device=args.device)
        ours = median_ms(partial(cuda.indexer_topk, q, keys, w, layout, topk), args.runs, args.cuda)
        base = median_ms(partial(torch_pipeline, q, keys, w, topk), args.runs, args.cuda)
        causal = t * (s - t) + t * (t + 1) // 2
        tflops = 2 * h_i * d_i * causal / (ours / 1e3) / 1e12
        rec = {
            "bench": "indexer_topk",
            "T": t,
            "S": s,
            "H_I": h_i,
            "D_I": d_i,
            "topk": topk,
            "dtype": str(dtype).removeprefix("torch."),
            "ms": round(ours, 4),
            "TFLOP/s": round(tflops, 2),
            "torch pipeline ms": round(base, 4),
            "ratio torch/ours": round(base / ours, 3),
        }
        if args.cuda:
            n = 8192
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            peak_ms = median_ms(partial(torch.matmul, a, a), args.runs, True)
            peak = 2 * n**3 / (peak_ms / 1e3) / 1e12
            rec |= {"bf16 matmul TFLOP/s": round(peak, 1), "fraction of bf16 matmul": round(tflops / peak, 3)}
        report(args, rec)


if __name__ == "__main__":
    main()
