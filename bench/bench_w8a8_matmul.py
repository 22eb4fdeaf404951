"""W8A8 GEMM (kernels_cuda.w8a8_matmul through the cuda backend) against `torch._int_mm` and a bf16 matmul of
the same shape, measured in the same run.

Shapes: GLM-5 projections (hidden 6144, dense intermediate 12288, o_proj in 16384) at prefill M=4096 and
decode M=64. Reports TFLOP/s (2*M*N*K, the scale epilogue included in ours, not in `_int_mm`), the ratio
ours / torch._int_mm (issue target: >= 0.7) and ours / bf16. Median of --runs runs after warm-up.

    python bench/bench_w8a8_matmul.py [--runs 10] [--json out.jsonl]
    python bench/bench_w8a8_matmul.py --tiny    # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [  # (M, N, K, what)
    (4096, 12288, 6144, "dense gate/up, prefill"),
    (4096, 6144, 12288, "dense down, prefill"),
    (4096, 2048, 6144, "q_a_proj, prefill"),
    (4096, 6144, 16384, "o_proj, prefill"),
    (64, 12288, 6144, "dense gate/up, decode"),
    (64, 6144, 16384, "o_proj, decode"),
]
TINY = [(24, 40, 64, "tiny"), (17, 32, 96, "tiny")]


def _maybe_ms(fn, args) -> float | None:
    """A baseline's median time, or None where torch rejects the shape (e.g. _int_mm limits)."""
    try:
        return median_ms(fn, args.runs, args.cuda)
    except RuntimeError:
        return None


def _one(args, cuda, m: int, n: int, k: int, what: str) -> None:
    import torch

    dev = args.device
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
    w_q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    x_s = torch.rand(m, device=dev) * 0.02
    w_s = torch.rand(n, device=dev) * 0.01
    x_bf, w_bf = x_q.to(torch.bfloat16), w_q.to(torch.bfloat16)
    ours = median_ms(
        lambda: cuda.w8a8_matmul(x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16), args.runs, args.cuda
    )
    int_mm = _maybe_ms(lambda: torch._int_mm(x_q, w_q.t()), args)
    bf16 = median_ms(lambda: x_bf @ w_bf.t(), args.runs, args.cuda)
    tflop = 2 * m * n * k / 1e12
    report(
        args,
        {
            "bench": "w8a8_matmul",
            "shape": f"M{m} N{n} K{k}",
            "what": what,
            "ms": round(ours, 4),
            "TFLOP/s": round(tflop / (ours / 1e3), 1),
            "torch._int_mm ms": None if int_mm is None else round(int_mm, 4),
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
