"""The error each FP8 op (SPEC 7) adds against the fp32 computation it replaces, at GLM-5 shapes, on the
reference backend (the numbers in docs/quantization.md). Metrics: DeepGEMM's calc_diff
1 - 2*sum(a*r)/sum(a^2 + r^2) (global), the largest error relative to the largest |r|, and the rms
relative error.

    OMP_NUM_THREADS=1 python bench/fp8_error.py [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from backends.layout import SeqLayout
from backends.reference.fp8_block_matmul import fp8_block_matmul
from backends.reference.fp8_format import mla_dequantize_rows, quantize_weight_blocks
from backends.reference.fp8_grouped_matmul import fp8_grouped_matmul
from backends.reference.fp8_indexer_logits import fp8_indexer_logits, quantize_indexer_inputs
from backends.reference.fp8_indexer_topk import fp8_indexer_topk
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant
from backends.reference.fp8_quant_group import fp8_quant_group
from backends.reference.fp8_sparse_mla_attention import fp8_sparse_mla_attention
from backends.reference.indexer_logits import indexer_logits
from backends.reference.indexer_topk import indexer_topk
from backends.reference.sparse_mla_attention import sparse_mla_attention


def stats(a: torch.Tensor, r: torch.Tensor) -> str:
    fin = torch.isfinite(r)
    a, r = a[fin].double(), r[fin].double()
    diff = float(1 - 2 * (a * r).sum() / (a * a + r * r).sum())
    err = (a - r).abs()
    worst, rms = err.max() / r.abs().max(), err.norm() / r.norm()
    return f"calc_diff {diff:.2e}  max|err|/max|r| {worst:.2e}  rms err/rms r {rms:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    g = torch.Generator().manual_seed(ap.parse_args().seed)
    rows = []

    x = torch.randn(64, 6144, generator=g).bfloat16()
    for ue8m0 in (False, True):
        q, s = fp8_quant_group(x, 128, 1e-4, ue8m0)
        rows.append(
            (
                f"fp8_quant_group (64 x 6144, ue8m0={ue8m0}): x_q*s vs x",
                stats(q.float() * s.repeat_interleave(128, 1), x.float()),
            )
        )

    w = torch.randn(2048, 6144, generator=g) * 0.02
    xq, xs = fp8_quant_group(x, 128, 1e-4, True)
    wq, ws = quantize_weight_blocks(w)
    rows.append(
        (
            "fp8_block_matmul (M64 K6144 N2048) vs fp32 x @ w^T",
            stats(fp8_block_matmul(xq, xs, wq, ws, None, torch.float32), x.float() @ w.T),
        )
    )

    counts = [9, 0, 30, 25]
    xe = torch.randn(sum(counts), 6144, generator=g)
    we = torch.randn(4, 256, 6144, generator=g) * 0.02
    xeq, xes = fp8_quant_group(xe, 128, 1e-4, True)
    weq, wes = zip(*(quantize_weight_blocks(we[e]) for e in range(4)))
    offs = torch.tensor([0, 9, 9, 39, 64])
    ref = torch.cat([xe[offs[e] : offs[e + 1]] @ we[e].T for e in range(4)])
    rows.append(
        (
            "fp8_grouped_matmul (E4 M64 K6144 N256) vs fp32",
            stats(fp8_grouped_matmul(xeq, xes, torch.stack(weq), torch.stack(wes), offs, torch.float32), ref),
        )
    )

    q_lens, k_lens = [1, 2, 4], [4500, 3000, 2100]
    layout = SeqLayout.from_lengths(q_lens, k_lens)
    q = torch.randn(7, 32, 128, generator=g).bfloat16()
    k = torch.randn(sum(k_lens), 128, generator=g).bfloat16()
    wt = torch.randn(7, 32, generator=g) * (32**-0.5 * 128**-0.5)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, wt)
    ref_logits = indexer_logits(q.float(), k.float(), wt, layout)
    rows.append(
        (
            "fp8_indexer_logits (H_I32 D128, S<=4500) vs fp32 indexer",
            stats(fp8_indexer_logits(q8, k8, ks, w8, layout), ref_logits),
        )
    )
    a = fp8_indexer_topk(q8, k8, ks, w8, layout, 2048)
    r = indexer_topk(q.float(), k.float(), wt, layout, 2048)
    share = (
        sum(
            len(set(x.tolist()) & set(y.tolist()) - {-1}) / max(1, len(set(y.tolist()) - {-1}))
            for x, y in zip(a, r)
        )
        / a.shape[0]
    )
    rows.append(("fp8_indexer_topk (top-2048) vs fp32 indexer_topk", f"set overlap {share:.4f}"))

    kv = (torch.randn(3000, 576, generator=g) / 10).clamp(-1, 1).bfloat16()
    rows_ = fp8_mla_cache_quant(kv)
    rows.append(
        (
            "fp8_mla_cache_quant (656 B rows) latent vs bf16 latent",
            stats(mla_dequantize_rows(rows_)[:, :512].float(), kv[:, :512].float()),
        )
    )
    lay = SeqLayout.from_lengths([2], [3000])
    qa = torch.randn(2, 64, 576, generator=g).clamp(-1, 1).bfloat16()
    idx = torch.stack([torch.randperm(3000, generator=g)[:2048] for _ in range(2)]).to(torch.int32)
    out8, lse8 = fp8_sparse_mla_attention(qa.float(), rows_, idx, lay, 576**-0.5, 512)
    out, lse = sparse_mla_attention(qa.float(), kv.float(), idx, lay, 576**-0.5, 512)
    rows.append(("fp8_sparse_mla_attention (H64 top-2048) out vs fp32 on the bf16 cache", stats(out8, out)))
    rows.append(("fp8_sparse_mla_attention lse", stats(lse8, lse)))
    for name, s in rows:
        print(f"{name:72s} {s}")


if __name__ == "__main__":
    main()
