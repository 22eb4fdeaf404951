"""W4A8 GEMM (kernels_cuda.w4a8_matmul through the cuda backend, per-channel and group 128) against
`torch._int_mm` on the unpacked int8 weights and a bf16 matmul of the same shape, measured in the same run.

Shapes: GLM-5 routed-expert GEMMs as one dense GEMM (w13: K=6144 -> N=4096, w2: K=2048 -> N=6144) at prefill
and decode M. Reports TFLOP/s (2*M*N*K) and speed ratios ours / baseline. Median of --runs runs.

    python bench/bench_w4a8_matmul.py [--runs 10] [--json out.jsonl]
    python bench/bench_w4a8_matmul.py --tiny    # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [  # (M, N, K, group_size or None for per-channel)
    (4096, 4096, 6144, None),
    (4096, 4096, 6144, 128),
    (4096, 6144, 2048, None),
    (64, 4096, 6144, None),
    (64, 4096, 6144, 128),
]
TINY = [(24, 40, 64, None), (17, 32, 128, 32)]


def _one(args, cuda, m: int, n: int, k: int, group: int | None) -> None:
    import torch

    from backends.reference.w4a8_matmul import pack_int4

    dev = args.device
    gs = group or k
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
    w = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
    w_packed = pack_int4(w)
    x_s = torch.rand(m, device=dev) * 0.02
    w_s = torch.rand(n, k // gs, device=dev) * 0.1
    x_bf, w_bf = x_q.to(torch.bfloat16), w.to(torch.bfloat16)
    ours = median_ms(
        lambda: cuda.w4a8_matmul(x_q, x_s, w_packed, w_s, gs, out_dtype=torch.bfloat16), args.runs, args.cuda
    )
    try:
        int_mm = median_ms(lambda: torch._int_mm(x_q, w.t()), args.runs, args.cuda)
    except RuntimeError:  # shapes torch._int_mm rejects
        int_mm = None
    bf16 = median_ms(lambda: x_bf @ w_bf.t(), args.runs, args.cuda)
    tflop = 2 * m * n * k / 1e12
    report(
        args,
        {
            "bench": "w4a8_matmul",
            "shape": f"M{m} N{n} K{k}",
            "scales": f"group {group}" if group else "per-channel",
            "ms": round(ours, 4),
            "TFLOP/s": round(tflop / (ours / 1e3), 1),
            "torch._int_mm (int8 weights) ms": None if int_mm is None else round(int_mm, 4),
            "ratio ours/_int_mm (speed)": None if int_mm is None else round(int_mm / ours, 3),
            "bf16 matmul ms": round(bf16, 4),
            "ratio ours/bf16 (speed)": round(bf16 / ours, 3),
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
