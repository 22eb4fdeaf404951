"""cuda backend: indexer_topk (SPEC 2.2) -> kernels_cuda.indexer_topk, the fused indexer + running
deterministic top-k (never writes [T, S]; scratch O(T * topk)); ragged and paged caches.

In the layout-invariant mode (SPEC 12): per block of queries, the mode's logits (`_indexer.exact_logits`:
exact products on the Triton engine, the heads' fixed tree), then kernels_cuda.topk on them (comparisons
only, the lower-index tie rule): the reference's indices in the mode."""

from __future__ import annotations

from typing import Any

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.cuda import _indexer
from backends.cuda.fp8_indexer_topk import IMPL as FP8_TOPK
from backends.invariant import engine as invariant
from backends.layout import SeqLayout
from backends.reference.fp8_indexer_logits import on_fp8_index_cache
from kernels_cuda.indexer_topk import MAX_TOPK
from kernels_cuda.indexer_topk import indexer_topk as _kernel
from kernels_cuda.topk import topk as _select


def _check(args: dict[str, Any]) -> list[str]:
    return _indexer.check(args, differentiable_output=False)  # indices: no gradient in any backend


def indexer_topk(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout, topk: int
) -> torch.Tensor:
    """q: [T, H_I, D_I]; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I]; weights: [T, H_I] fp32.
    Returns int32 [T, topk] logical positions in rule order, -1 past the causal keys.
    Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
    """
    if invariant.active():
        return _exact(q, k_cache, weights, layout, topk)
    return _kernel(q, k_cache, weights, topk=topk, **_indexer.layout_args(layout))


def _exact(q, k_cache, weights, layout: SeqLayout, topk: int) -> torch.Tensor:
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for a, z, logits, visible in _indexer.exact_logits(q, k_cache, weights, layout):
        k = min(topk, logits.shape[1])
        out[a:z, :k] = _select(logits, k, visible)[1]
    return out


IMPL = by_kind(
    OpImpl(
        indexer_topk,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            limits=_indexer.LIMITS
            + (
                Limit(
                    "topk", max=MAX_TOPK, reason="the final sort keeps topk pairs per query in one program"
                ),
            ),
            check=_check,
            run_to_run=True,
            batch_invariant=True,
            tie_rule="lower_index",
            layout_invariant=True,
        ),
    ),
    dict.fromkeys(FP8_KINDS, on_fp8_index_cache(FP8_TOPK)),  # the FP8 indexer cache (SPEC 7.8)
)
