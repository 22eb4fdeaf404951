"""cuda backend: fp8_indexer_logits (SPEC 7.4) -> kernels_cuda.fp8_indexer (ragged and paged caches, the
block-table lookup in the kernel; e4m3 tl.dot, k_scale after the head sum as DeepSeek's fp8_index)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FP8
from backends.cuda import _indexer
from backends.cuda.fp8_common import chain, fp8_reasons
from backends.layout import SeqLayout
from kernels_cuda.fp8_indexer import fp8_indexer_logits as _kernel


def _limits(args) -> list[str]:
    return _indexer.check(args, differentiable_output=False)


def fp8_indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """Semantics: backends/reference/fp8_indexer_logits.py (SPEC 7.4)"""
    return _kernel(q, k_cache, k_scale, weights, s_max=layout.seqlen_k_max(), **_indexer.layout_args(layout))


IMPL = OpImpl(
    fp8_indexer_logits,
    OpCaps(
        FP8,
        ("ragged", "paged"),
        limits=_indexer.LIMITS,
        notes={"GPU": "sm_89+"},
        check=chain(fp8_reasons, _limits),
    ),
)
