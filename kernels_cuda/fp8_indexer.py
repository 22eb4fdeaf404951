"""FP8 lightning-indexer logits and top-k (SPEC 7.4, 7.5): e4m3 queries against an e4m3 key cache with
one fp32 scale per key (DeepSeek-V3.2 `fp8_index`, DeepGEMM `fp8_mqa_logits` / `fp8_paged_mqa_logits`).

The kernels are the bf16 indexer's (kernels_cuda/indexer_logits.py, kernels_cuda/indexer_topk.py; a tile's
(query, head) rows are the M side of one dot, keys read through the layout in the kernel) with the per-key
scale switched on; the e4m3 operands are widened to fp16 (exactly) for the dot:
    dots = tl.dot(fp16(q8) [BLOCK_T*HP, BD], fp16(k8)^T [BD, BS]) -> fp32 (exact products summed in fp32;
           the native e4m3 dot of an H200 missed SPEC 7.4's tolerance by ~1e-4 relative on the first device
           run, 2026-12-04: its accumulator is narrower than fp32, as DeepSeek-V3's report describes),
    logits = k_scale[row] * sum_h weights[t, h] * relu(dots)          (scale after the head sum, as fp8_index)
-inf where not causal. fp32 results agree with the fp64 reference to rounding, not bitwise.
Top-k: the fused kernel of kernels_cuda/indexer_topk.py scores the same way (the per-key scale after the
head sum) into its running per-query top-k, so the [T, S] logits are never materialised: scratch is
O(T * topk), as for the bf16 indexer.
"""

from __future__ import annotations

import torch

from kernels_cuda.indexer_logits import indexer_logits as _logits
from kernels_cuda.indexer_topk import indexer_topk as _fused_topk


def fp8_indexer_logits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    s_max: int,
) -> torch.Tensor:
    """q e4m3 [T, H_I, D_I]; k_cache e4m3 ragged [rows, D_I] / paged [nb, bs, D_I]; k_scale fp32 [rows] /
    [nb, bs]; weights fp32 [T, H_I] -> [T, s_max] fp32: kernels_cuda.indexer_logits with the per-key scale.
    Semantics: backends/reference/fp8_indexer_logits.py"""
    return _logits(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, s_max, k_scale)


def fp8_indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> torch.Tensor:
    """int32 [T, topk]: the rule's top-k of `fp8_indexer_logits` over each query's causal keys, -1 after,
    fused (the logits are never materialised: kernels_cuda.indexer_topk with the per-key scale).
    Semantics: backends/reference/fp8_indexer_topk.py (SPEC 7.5)"""
    return _fused_topk(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, topk, k_scale)
