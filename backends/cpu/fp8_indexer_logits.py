"""cpu backend: fp8_indexer_logits (SPEC 7.4): each request's e4m3 keys decoded once to fp32 (exact),
then the float indexer's GEMM path (`backends/cpu/indexer_logits.py::scores`: all heads' dots in one
GEMM, ReLU in place, the head-weighted sum as a batched GEMV) and the per-key scale. fp32 sums where the
reference's are exact: within the `reduction` tolerance, not bitwise (fp8_indexer_topk is the exact one).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FP8
from backends.cpu._cache import causal_counts
from backends.cpu._fp8 import decode
from backends.cpu._fp8_index import request_keys
from backends.cpu.indexer_logits import BLOCK_ELEMS, scores
from backends.layout import SeqLayout


def fp8_indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """Returns [T, max(seqlens_k)] fp32, -inf where not causal.
    Semantics: backends/reference/fp8_indexer_logits.py (SPEC 7.4)"""
    t, h_i, _ = q.shape
    bounds = layout.request_bounds()
    out = torch.full((t, max((s for _, _, s in bounds), default=0)), float("-inf"), dtype=torch.float32)
    qf, wf = decode(q.contiguous()), weights.float()
    for b, (q0, q1, s) in enumerate(bounds):
        if q1 == q0 or s == 0:
            continue
        keys, ks = request_keys(k_cache, k_scale, layout, b, s, torch.float32)
        visible = causal_counts(q1 - q0, s)
        step = max(1, BLOCK_ELEMS // (h_i * s))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            sc = scores(qf[a:z], keys, wf[a:z]).mul_(ks)
            causal = torch.arange(s)[None, :] < visible[a - q0 : z - q0, None]
            out[a:z, :s] = sc.masked_fill_(~causal, float("-inf"))
    return out


IMPL = OpImpl(
    fp8_indexer_logits,
    OpCaps(FP8, ("ragged", "paged"), notes={"sums": "fp32 GEMM order (reduction tolerance)"}),
)
