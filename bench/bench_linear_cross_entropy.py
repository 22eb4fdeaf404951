"""Chunked linear + cross-entropy, forward and backward (the cuda backend's linear_cross_entropy) against
torch's dense path (logits = h @ W^T in fp32, F.cross_entropy, autograd) in the same run.

Shapes: GLM-5's output projection (hidden 6144, vocab 154880) for 4096 and 16384 tokens, bf16. Reports time
of forward + backward, TFLOP/s over the model FLOPs (6*N*V*D: logits, grad_h, grad_W; our backward
recomputes the logits, 8*N*V*D executed), peak device memory of each, and the speed ratio.

    python bench/bench_linear_cross_entropy.py [--runs 5] [--json out.jsonl]
    python bench/bench_linear_cross_entropy.py --tiny          # no GPU: interpreted, tiny shapes
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

SHAPES = [(4096, 6144, 154880), (16384, 6144, 154880)]  # (N tokens, D hidden, V vocab)
TINY = [(16, 32, 300)]


def _peak(torch, fn, cuda: bool) -> float | None:
    """Peak device memory (GiB) above what was allocated before `fn`."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)


def _one(args, cuda, n: int, d: int, v: int) -> None:
    import torch
    import torch.nn.functional as F

    dev = args.device
    dtype = torch.float32 if args.tiny and not args.cuda else torch.bfloat16
    h = torch.randn(n, d, device=dev).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device=dev) * d**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)

    def ours():
        h.grad = w.grad = None
        cuda.linear_cross_entropy(h, w, t).backward()

    def dense():
        h.grad = w.grad = None
        F.cross_entropy((h @ w.t()).float(), t).backward()

    ms, ms_dense = median_ms(ours, args.runs, args.cuda), median_ms(dense, args.runs, args.cuda)
    tflop = 6 * n * v * d / 1e12
    report(
        args,
        {
            "bench": "linear_cross_entropy",
            "shape": f"N{n} D{d} V{v}",
            "dtype": str(dtype)[6:],
            "ms fwd+bwd": round(ms, 3),
            "TFLOP/s (model)": round(tflop / (ms / 1e3), 1),
            "peak GiB": _peak(torch, ours, args.cuda),
            "dense torch ms": round(ms_dense, 3),
            "dense peak GiB": _peak(torch, dense, args.cuda),
            "ratio ours/dense (speed)": round(ms_dense / ms, 3),
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
