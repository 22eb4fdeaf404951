"""Dynamic per-row int8 quantization (kernels_cuda.dynamic_quant_int8 through the cuda backend) against the
same formula in eager torch ops on the same device (the reference's body), measured in the same run.

Shapes: GLM-5 activations (hidden 6144, dense intermediate 12288, MoE intermediate 2048) at prefill and
decode. Reports GB/s over the bytes moved once (x read, x_q and scale written) and the speed ratio.
Median of --runs runs after warm-up.

    python bench/bench_dynamic_quant_int8.py [--runs 10] [--json out.jsonl]
    python bench/bench_dynamic_quant_int8.py --tiny          # no GPU: interpreted, tiny shapes
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(4096, 6144), (4096, 12288), (32768, 2048), (64, 6144)]  # (M, K), bf16 input
TINY = [(33, 300), (4, 1000)]


def _eager(torch, x):
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _one(args, cuda, m: int, k: int) -> None:
    import torch

    dtype = torch.float32 if args.tiny and not args.cuda else torch.bfloat16
    x = torch.randn(m, k, device=args.device).to(dtype)
    ours = median_ms(lambda: cuda.dynamic_quant_int8(x), args.runs, args.cuda)
    eager = median_ms(lambda: _eager(torch, x), args.runs, args.cuda)
    same = all(torch.equal(a, b) for a, b in zip(cuda.dynamic_quant_int8(x), _eager(torch, x), strict=True))
    gbytes = (m * k * (x.element_size() + 1) + 4 * m) / 1e9
    report(
        args,
        {
            "bench": "dynamic_quant_int8",
            "shape": f"M{m} K{k}",
            "dtype": str(dtype)[6:],
            "ms": round(ours, 4),
            "GB/s": round(gbytes / (ours / 1e3), 1),
            "eager torch ms": round(eager, 4),
            "ratio ours/eager (speed)": round(eager / ours, 3),
            "bitwise equal to eager": same,
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
