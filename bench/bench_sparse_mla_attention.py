"""Sparse MLA attention (cuda backend) forward and backward against dense SDPA with a mask, same run.

GLM-5 prefill: H=64, d_qk=576, d_v=512, topk=2048, sm_scale=0.0625, T queries over one request of S keys,
ragged cache; indices are `topk` distinct causal positions per query (all of them when fewer). FLOPs =
2 * T * topk * H * (d_qk + d_v) forward (the issue's target: >= 400 TFLOP/s on an H200) and 2.5x that
backward. Baseline: torch SDPA on the dense [T, S] problem with a boolean mask of the same selected keys
(MQA via enable_gqa), timed in the same run; ratio = SDPA time / ours. Median of --runs runs after warm-up.

    python bench/bench_sparse_mla_attention.py [--runs 10] [--json out.jsonl]
    python bench/bench_sparse_mla_attention.py --tiny   # no GPU: interpreted, tiny shapes
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(4096, 8192), (2048, 32768)]  # (T, S), bf16, H=64, d_qk=576, d_v=512, topk=2048
TINY = [(3, 100)]  # float16, H=4, d_qk=48, d_v=32, topk=24


def causal_topk(t: int, s: int, topk: int, device: str, gen):
    import torch

    idx = torch.full((t, topk), -1, dtype=torch.int32, device=device)
    for i in range(t):
        n = s - t + i + 1
        pick = (
            torch.randperm(n, generator=gen, device=device)[:topk]
            if n > topk
            else torch.arange(n, device=device)
        )
        idx[i, : pick.numel()] = pick.to(torch.int32)
    return idx


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import torch
    import torch.nn.functional as F

    import backends
    from backends import SeqLayout

    cuda = backends.get("cuda")
    gen = torch.Generator(device=args.device).manual_seed(0)
    h, d_qk, d_v, topk, dtype = (
        (4, 48, 32, 24, torch.float16) if args.tiny else (64, 576, 512, 2048, torch.bfloat16)
    )
    for t, s in TINY if args.tiny else SHAPES:
        q = torch.randn(t, h, d_qk, generator=gen, device=args.device).to(dtype)
        kv = torch.randn(s, d_qk, generator=gen, device=args.device).to(dtype)
        idx = causal_topk(t, s, topk, args.device, gen)
        layout = SeqLayout.from_lengths([t], [s], device=args.device)
        attend = partial(cuda.sparse_mla_attention, q, kv, idx, layout, 0.0625, d_v)
        fwd = median_ms(attend, args.runs, args.cuda)
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, _ = cuda.sparse_mla_attention(qg, kvg, idx, layout, 0.0625, d_v)
        d_out = torch.randn_like(out)
        grad = partial(torch.autograd.grad, out, (qg, kvg), d_out, retain_graph=True)
        bwd = median_ms(grad, args.runs, args.cuda)
        # -1 slots scatter into a spare last column, dropped after
        slots = torch.where(idx >= 0, idx.long(), s)
        mask = torch.zeros(t, s + 1, dtype=torch.bool, device=args.device).scatter_(1, slots, True)[:, :s]
        qd, kd, vd = q.transpose(0, 1)[None], kv[None, None], kv[None, None, :, :d_v]
        sdpa = partial(
            F.scaled_dot_product_attention, qd, kd, vd, attn_mask=mask, scale=0.0625, enable_gqa=True
        )
        base = median_ms(sdpa, args.runs, args.cuda)
        flops = 2 * t * topk * h * (d_qk + d_v)
        report(
            args,
            {
                "bench": "sparse_mla_attention",
                "T": t,
                "S": s,
                "H": h,
                "d_qk": d_qk,
                "d_v": d_v,
                "topk": topk,
                "dtype": str(dtype).removeprefix("torch."),
                "fwd ms": round(fwd, 4),
                "fwd TFLOP/s": round(flops / (fwd / 1e3) / 1e12, 2),
                "bwd ms": round(bwd, 4),
                "bwd TFLOP/s": round(2.5 * flops / (bwd / 1e3) / 1e12, 2),
                "dense masked SDPA ms": round(base, 4),
                "ratio SDPA/ours fwd": round(base / fwd, 3),
            },
        )


if __name__ == "__main__":
    main()
