"""cuda backend: fp8_indexer_topk (SPEC 7.5) -> kernels_cuda.fp8_indexer: the fused indexer top-k kernel
(kernels_cuda/indexer_topk.py) on e4m3 queries and keys, each key's fp32 scale applied after the head
sum, selected into a running per-query top-k (lower index first). The [T, S] logits are never
materialised: scratch is O(T * topk), as for the bf16 indexer_topk."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FP8
from backends.cuda import _indexer
from backends.cuda.fp8_common import chain, fp8_reasons
from backends.layout import SeqLayout
from kernels_cuda.fp8_indexer import fp8_indexer_topk as _kernel
from kernels_cuda.indexer_topk import MAX_TOPK


def _limits(args) -> list[str]:
    return _indexer.check(args, differentiable_output=False)


def fp8_indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    layout: SeqLayout,
    topk: int,
) -> torch.Tensor:
    """Semantics: backends/reference/fp8_indexer_topk.py (SPEC 7.5)"""
    return _kernel(
        q,
        k_cache,
        k_scale,
        weights,
        topk,
        layout.cu_seqlens_q,
        layout.seqlens_k,
        layout.cu_seqlens_k,
        layout.block_table,
    )


IMPL = OpImpl(
    fp8_indexer_topk,
    OpCaps(
        FP8,
        ("ragged", "paged"),
        limits=_indexer.LIMITS
        + (Limit("topk", max=MAX_TOPK, reason="the final sort keeps topk pairs in one program"),),
        notes={"GPU": "sm_89+"},
        check=chain(fp8_reasons, _limits),
        tie_rule="lower_index",
    ),
)
