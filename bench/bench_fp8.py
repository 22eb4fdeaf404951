"""The cuda backend's FP8 kernels (SPEC 7) against the bf16 path they replace, measured in the same run.

- fp8_block_matmul (1 x 128 activation groups, 128 x 128 weight blocks) vs a bf16 matmul of the same shape,
  GLM-5 projections at prefill M=4096 and decode M=64: TFLOP/s and the speed ratio bf16 / ours;
- fp8_quant_group of the activations: GB/s read;
- fp8_indexer_topk (fused: e4m3 queries and keys, per-key scale) vs the bf16 indexer_topk kernel, decode of
  8 requests at 16K keys, H_I 32, D_I 128, top-2048;
- fp8_sparse_mla_attention (656-byte FlashMLA rows, de-quantized in the kernel) vs sparse_mla_attention on
  the bf16 cache, decode of 8 requests, H 64, top-2048 of 16K keys.
Median of --runs runs after warm-up.

    python bench/bench_fp8.py [--runs 10] [--json out.jsonl]
    python bench/bench_fp8.py --tiny    # no GPU: interpreted, tiny shapes (proves the script runs)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import median_ms, parse, report  # noqa: E402

GEMMS = [
    (4096, 2048, 6144, "q_a_proj, prefill"),
    (4096, 6144, 16384, "o_proj, prefill"),
    (64, 2048, 6144, "q_a_proj, decode"),
    (64, 6144, 16384, "o_proj, decode"),
]
TINY_GEMMS = [(24, 40, 300, "tiny")]
DECODE = dict(batch=8, keys=16384, topk=2048, heads=64, index_heads=32)
TINY_DECODE = dict(batch=2, keys=96, topk=16, heads=16, index_heads=4)


def _gemm(args, cuda, m: int, n: int, k: int, what: str) -> None:
    import torch

    from backends.formats import quantize_weight_blocks

    dev, g = args.device, torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.02
    w_q, w_s = (t.to(dev) for t in quantize_weight_blocks(w))
    x_q, x_s = cuda.fp8_quant_group(x, 128, 1e-4, False)
    w_bf = w.to(dev, torch.bfloat16)
    ours = median_ms(
        lambda: cuda.fp8_block_matmul(x_q, x_s, w_q, w_s, None, torch.bfloat16), args.runs, args.cuda
    )
    quant = median_ms(lambda: cuda.fp8_quant_group(x, 128, 1e-4, False), args.runs, args.cuda)
    bf16 = median_ms(lambda: x @ w_bf.t(), args.runs, args.cuda)
    tflop = 2 * m * n * k / 1e12
    report(
        args,
        {
            "bench": "fp8_block_matmul",
            "shape": f"M{m} N{n} K{k}",
            "what": what,
            "ms": round(ours, 4),
            "TFLOP/s": round(tflop / (ours / 1e3), 1),
            "bf16 matmul ms": round(bf16, 4),
            "ratio bf16/ours (speed)": round(bf16 / ours, 3),
            "fp8_quant_group ms": round(quant, 4),
            "fp8_quant_group GB/s read": round(x.numel() * 2 / (quant / 1e3) / 1e9, 1),
        },
    )


def _decode(args, cuda, batch: int, keys: int, topk: int, heads: int, index_heads: int) -> None:
    import torch

    from backends import SeqLayout
    from backends.formats import quantize_indexer_inputs

    dev, g = args.device, torch.Generator().manual_seed(1)
    layout = SeqLayout.from_lengths([1] * batch, [keys] * batch, device=dev)
    layout.max_seqlen_k, layout.trusted = keys, True
    q = torch.randn(batch, index_heads, 128, generator=g)
    k = torch.randn(batch * keys, 128, generator=g)
    w = torch.randn(batch, index_heads, generator=g) * (index_heads**-0.5 * 128**-0.5)
    q8, k8, ks, w8 = (t.to(dev) for t in quantize_indexer_inputs(q, k, w))
    qb, kb, wb = q.to(dev, torch.bfloat16), k.to(dev, torch.bfloat16), w.to(dev)
    fp8 = median_ms(lambda: cuda.fp8_indexer_topk(q8, k8, ks, w8, layout, topk), args.runs, args.cuda)
    bf16 = median_ms(lambda: cuda.indexer_topk(qb, kb, wb, layout, topk), args.runs, args.cuda)
    report(
        args,
        {
            "bench": "fp8_indexer_topk",
            "shape": f"B{batch} S{keys} H_I{index_heads} top{topk}",
            "ms": round(fp8, 4),
            "bf16 indexer_topk ms": round(bf16, 4),
            "ratio bf16/ours (speed)": round(bf16 / fp8, 3),
        },
    )

    kv = (torch.randn(batch * keys, 576, generator=g) / 10).clamp(-1, 1).to(dev, torch.bfloat16)
    rows = cuda.fp8_mla_cache_quant(kv)
    qa = torch.randn(batch, heads, 576, generator=g).clamp(-1, 1).to(dev, torch.bfloat16)
    idx = torch.stack([torch.randperm(keys, generator=g)[:topk] for _ in range(batch)]).to(dev, torch.int32)
    scale = 576**-0.5

    def attn(op, cache):
        return lambda: op(qa, cache, idx, layout, scale, 512, return_lse=False)

    fp8 = median_ms(attn(cuda.fp8_sparse_mla_attention, rows), args.runs, args.cuda)
    bf16 = median_ms(attn(cuda.sparse_mla_attention, kv), args.runs, args.cuda)
    report(
        args,
        {
            "bench": "fp8_sparse_mla_attention",
            "shape": f"B{batch} H{heads} top{topk} of {keys}",
            "ms": round(fp8, 4),
            "cache bytes per token": 656,
            "bf16 sparse_mla_attention ms": round(bf16, 4),
            "bf16 cache bytes per token": 1152,
            "ratio bf16/ours (speed)": round(bf16 / fp8, 3),
        },
    )


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    import backends

    cuda = backends.get("cuda")
    for shape in TINY_GEMMS if args.tiny else GEMMS:
        _gemm(args, cuda, *shape)
    _decode(args, cuda, **(TINY_DECODE if args.tiny else DECODE))


if __name__ == "__main__":
    main()
