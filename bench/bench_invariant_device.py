"""The layout-invariant mode on a device (docs/spec.md section 12): its exact product on the Triton engine
(int8 digit products, int32 level sums: kernels_cuda/invariant_gemm.py) against the fp32, bf16 and int8
GEMMs of the same shapes, and the cuda backend's sparse_mla_attention in the mode against its normal
kernel, in the same run; ratios printed. GLM-5's shapes: an input projection [T, 6144] x [6144, 2048], an
expert's down projection [T, 2048] x [2048, 6144], attention at 64 heads, 576 / 512, top-k 2048.

    python bench/bench_invariant_device.py [--runs 10] [--json FILE]
    python bench/bench_invariant_device.py --tiny   # no GPU: the interpreter, small shapes, no figures
"""

from __future__ import annotations

from functools import partial

from _harness import median_ms, parse, report

GEMMS = ((4096, 6144, 2048), (4096, 2048, 6144), (64, 6144, 2048))
TINY_GEMMS = ((5, 40, 7),)
ATTENTION = (64, 576, 512, 2048, 4096, 8192)  # heads, d_qk, d_v, topk, T, S
TINY_ATTENTION = (2, 24, 16, 8, 3, 40)


def gemms(args, torch) -> None:
    from backends.invariant.engine import exact_matmul

    gen = torch.Generator(device=args.device).manual_seed(0)
    for m, k, n in TINY_GEMMS if args.tiny else GEMMS:
        a = torch.randn(m, k, generator=gen, device=args.device)
        w = torch.randn(k, n, generator=gen, device=args.device)
        a8 = torch.randint(-64, 65, (m, k), dtype=torch.int8, generator=gen, device=args.device)
        w8 = torch.randint(-64, 65, (n, k), dtype=torch.int8, generator=gen, device=args.device).T
        times = {"fp32": median_ms(partial(torch.matmul, a, w), args.runs, args.cuda)}
        if args.cuda:  # the interpreter's CPU has no bf16 / int8 GEMMs worth timing beside it
            bf16 = partial(torch.matmul, a.bfloat16(), w.bfloat16())
            times["bf16"] = median_ms(bf16, args.runs, args.cuda)
            if m > 16:  # torch._int_mm's CUDA shape rule
                times["int8 _int_mm"] = median_ms(partial(torch._int_mm, a8, w8), args.runs, args.cuda)
        exact = partial(exact_matmul, a, w, engine="triton")
        times["exact (triton)"] = median_ms(exact, args.runs, args.cuda)
        flops = 2 * m * k * n
        report(
            args,
            {
                "bench": "invariant_gemm",
                "M": m,
                "K": k,
                "N": n,
                **{f"{name} ms": round(ms, 4) for name, ms in times.items()},
                **{f"{name} T(FL)OP/s": round(flops / ms / 1e9, 2) for name, ms in times.items()},
                "exact / fp32 time": round(times["exact (triton)"] / times["fp32"], 3),
            },
        )


def attention(args, torch, backends) -> None:
    from backends import SeqLayout
    from glm5.parallel.invariant import layout_invariant

    h, d_qk, d_v, topk, t, s = TINY_ATTENTION if args.tiny else ATTENTION
    gen = torch.Generator(device=args.device).manual_seed(0)
    q = torch.randn(t, h, d_qk, generator=gen, device=args.device)
    kv = torch.randn(s, d_qk, generator=gen, device=args.device)
    idx = torch.randint(0, s, (t, topk), generator=gen, device=args.device, dtype=torch.int32)
    layout = SeqLayout.from_lengths([t], [s], device=args.device)
    cuda = backends.get("cuda")
    attend = partial(cuda.sparse_mla_attention, q, kv, idx, layout, 0.0625, d_v)

    def invariant():
        with layout_invariant(cuda):
            attend()

    normal_ms, inv_ms = median_ms(attend, args.runs, args.cuda), median_ms(invariant, args.runs, args.cuda)
    report(
        args,
        {
            "bench": "invariant_sparse_mla_attention",
            "T": t,
            "S": s,
            "H": h,
            "d_qk": d_qk,
            "d_v": d_v,
            "topk": topk,
            "dtype": "float32",
            "normal ms": round(normal_ms, 4),
            "invariant ms": round(inv_ms, 4),
            "invariant / normal time": round(inv_ms / normal_ms, 3),
        },
    )


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import torch

    import backends

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline is fp32
    gemms(args, torch)
    attention(args, torch, backends)


if __name__ == "__main__":
    main()
