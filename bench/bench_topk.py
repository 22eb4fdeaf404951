"""Deterministic top-k (kernels_cuda.topk through the cuda backend) against `torch.topk` in the same run.

Shapes: the indexer's 2048 of 128K columns (the issue's target: no slower than torch.topk), 8192 of 256K
(the largest served), and MoE routing's 8 of 256. Reports GB/s over the input bytes read once and the
ratio torch.topk time / ours (> 1: ours is faster). Median of --runs runs after warm-up.

    python bench/bench_topk.py [--runs 10] [--json out.jsonl]
    python bench/bench_topk.py --tiny          # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [  # (rows, columns, k, dtype)
    (1024, 131072, 2048, "float32"),
    (4096, 131072, 2048, "bfloat16"),
    (64, 262144, 8192, "float32"),
    (16384, 256, 8, "float32"),
]
TINY = [(3, 600, 32, "float32"), (2, 300, 8, "float16")]


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import torch

    import backends

    cuda = backends.get("cuda")
    gen = torch.Generator(device=args.device).manual_seed(0)
    for r, c, k, dt in TINY if args.tiny else SHAPES:
        dtype = getattr(torch, dt)
        x = torch.randn(r, c, generator=gen, device=args.device).to(dtype)
        ours = median_ms(partial(cuda.topk, x, k), args.runs, args.cuda)
        base = median_ms(partial(torch.topk, x, k, dim=1, sorted=True), args.runs, args.cuda)
        same = torch.equal(cuda.topk(x, k)[0].float(), torch.topk(x, k, dim=1).values.float())
        gbytes = r * c * x.element_size() / 1e9
        report(
            args,
            {
                "bench": "topk",
                "rows": r,
                "columns": c,
                "k": k,
                "dtype": dt,
                "ms": round(ours, 4),
                "GB/s": round(gbytes / (ours / 1e3), 1),
                "torch.topk ms": round(base, 4),
                "ratio torch.topk/ours": round(base / ours, 3),
                "same values as torch.topk": same,
            },
        )


if __name__ == "__main__":
    main()
