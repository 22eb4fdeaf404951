"""MoE grouped GEMM (kernels_cuda.grouped_matmul through the cuda backend: one launch over all experts) for
bf16, W8A8 and W4A8 (per-channel, GLM-5's recipe) against, in the same run, a dense bf16 matmul of the same
FLOPs (an upper bound: no routing, one weight) and a torch loop of one bf16 matmul per expert.

Shapes: GLM-5 routed experts (256 experts, top-8, w13: K=6144 -> N=4096) at prefill (4096 tokens -> M=32768
rows, ~128 per expert) and decode (64 tokens -> M=512, ~2 per expert), tokens routed uniformly at random.
Reports TFLOP/s (2*M*N*K) and speed ratios. Median of --runs runs after warm-up.

    python bench/bench_grouped_matmul.py [--runs 10] [--json out.jsonl]
    python bench/bench_grouped_matmul.py --tiny    # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(4096, 8, 256, 4096, 6144), (64, 8, 256, 4096, 6144)]  # (tokens, top-k, experts, N, K)
TINY = [(12, 2, 4, 32, 64)]
VARIANTS = ("bfloat16", "w8a8", "w4a8")


def _inputs(torch, variant, m, e, n, k, dev):
    from backends.reference.w4a8_matmul import pack_int4

    if variant == "bfloat16":
        return dict(
            x=torch.randn(m, k, device=dev).to(torch.bfloat16),
            w=(torch.randn(e, n, k, device=dev) * k**-0.5).to(torch.bfloat16),
        )
    x = dict(
        x=torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev),
        x_scale=torch.rand(m, device=dev) * 0.02,
        out_dtype=torch.bfloat16,
    )
    if variant == "w8a8":
        return x | dict(
            w=torch.randint(-128, 128, (e, n, k), dtype=torch.int8, device=dev),
            w_scale=torch.rand(e, n, device=dev) * 0.01,
        )
    return x | dict(
        w=pack_int4(torch.randint(-8, 8, (e, n, k), dtype=torch.int8, device=dev)),
        w_scale=torch.rand(e, n, 1, device=dev) * 0.1,
        group_size=k,
    )


def _variant(args, cuda, variant: str, offs, e: int, n: int, k: int) -> float:
    """Median ms of one grouped_matmul variant; its weights are freed on return."""
    import torch

    a = _inputs(torch, variant, int(offs[-1]), e, n, k, args.device)
    return median_ms(lambda: cuda.grouped_matmul(group_offsets=offs, **a), args.runs, args.cuda)


def _baselines(args, x_bf, bounds: list[int], e: int, n: int, k: int) -> tuple[float, float]:
    """Median ms of a dense bf16 matmul of the same FLOPs and of a torch loop of per-expert bf16 matmuls."""
    import torch

    w_bf = (torch.randn(e, n, k, device=args.device) * k**-0.5).to(torch.bfloat16)
    dense = median_ms(lambda: x_bf @ w_bf[0].t(), args.runs, args.cuda)
    loop = median_ms(
        lambda: [x_bf[bounds[i] : bounds[i + 1]] @ w_bf[i].t() for i in range(e)], args.runs, args.cuda
    )
    return dense, loop


def _one(args, cuda, tokens: int, topk: int, e: int, n: int, k: int) -> None:
    import torch

    dev, m = args.device, tokens * topk
    counts = torch.bincount(torch.randint(0, e, (m,)), minlength=e)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dev)
    bounds = offs.tolist()
    x_bf = torch.randn(m, k, device=dev).to(torch.bfloat16)
    dense, loop = _baselines(args, x_bf, bounds, e, n, k)
    tflop = 2 * m * n * k / 1e12
    for variant in VARIANTS:
        ours = _variant(args, cuda, variant, offs, e, n, k)
        if args.cuda:
            torch.cuda.empty_cache()
        report(
            args,
            {
                "bench": "grouped_matmul",
                "variant": variant,
                "shape": f"E{e} M{m} N{n} K{k}",
                "rows/expert": round(m / e, 1),
                "ms": round(ours, 4),
                "TFLOP/s": round(tflop / (ours / 1e3), 1),
                "dense bf16 ms": round(dense, 4),
                "ratio ours/dense bf16 (speed)": round(dense / ours, 3),
                "torch per-expert bf16 loop ms": round(loop, 4),
                "ratio ours/loop (speed)": round(loop / ours, 3),
            },
        )


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import backends

    cuda = backends.get("cuda")
    for shape in TINY if args.tiny else SHAPES:
        _one(args, cuda, *shape)


if __name__ == "__main__":
    main()
