"""silu_and_mul (SPEC 2.10; kernels_cuda.silu_and_mul through the cuda backend) against eager torch's
`silu(gate) * up` on the same device (three kernels forward), forward and forward + backward, measured in
the same run.

Shapes: GLM-5's MoE expert intermediate (2048) over a prefill's routed rows, the dense intermediate
(12288) at prefill and decode. Reports GB/s over the bytes moved once (x read, out written) and the
speed ratio. Median of --runs runs after warm-up.

    python bench/bench_silu_and_mul.py [--runs 10] [--json out.jsonl]
    python bench/bench_silu_and_mul.py --tiny          # no GPU: interpreted, tiny shapes
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(32768, 2048), (4096, 12288), (64, 12288)]  # (M, N): x is [M, 2N] bf16
TINY = [(33, 300), (4, 1000)]


def _eager(torch, x):
    n = x.shape[1] // 2
    return torch.nn.functional.silu(x[:, :n]) * x[:, n:]


def _train(fn, x, dy):
    x = x.detach().requires_grad_()
    fn(x).backward(dy)
    return x.grad


def _one(args, cuda, m: int, n: int) -> None:
    import torch

    dtype = torch.float32 if args.tiny and not args.cuda else torch.bfloat16
    x = torch.randn(m, 2 * n, device=args.device).to(dtype)
    dy = torch.randn(m, n, device=args.device).to(dtype)
    ours = median_ms(lambda: cuda.silu_and_mul(x), args.runs, args.cuda)
    eager = median_ms(lambda: _eager(torch, x), args.runs, args.cuda)
    ours_train = median_ms(lambda: _train(cuda.silu_and_mul, x, dy), args.runs, args.cuda)
    eager_train = median_ms(lambda: _train(lambda t: _eager(torch, t), x, dy), args.runs, args.cuda)
    gbytes = 3 * m * n * x.element_size() / 1e9
    report(
        args,
        {
            "bench": "silu_and_mul",
            "shape": f"M{m} N{n}",
            "dtype": str(dtype)[6:],
            "ms": round(ours, 4),
            "GB/s": round(gbytes / (ours / 1e3), 1),
            "eager torch ms": round(eager, 4),
            "ratio ours/eager (speed)": round(eager / ours, 3),
            "fwd+bwd ms": round(ours_train, 4),
            "eager fwd+bwd ms": round(eager_train, 4),
            "max abs diff vs eager": float(
                (cuda.silu_and_mul(x).float() - _eager(torch, x).float()).abs().max()
            ),
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
