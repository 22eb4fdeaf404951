"""fp8_indexer_logits (SPEC 7.4): the indexer's scores on e4m3 q and keys (DeepGEMM's fp8_mqa_logits)."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FP8, dtype_of, randn
from backends.layout import SeqLayout
from backends.reference.indexer_logits import QUANTITIES as INDEXER_QUANTITIES
from backends.reference.indexer_logits import fake as indexer_logits_fake


def fp8_indexer_logits(
    q: Tensor, k_cache: Tensor, k_scale: Tensor, weights: Tensor, layout: SeqLayout
) -> Tensor:
    """q e4m3 [T, H_I, D_I], k_cache e4m3 ragged [rows, D_I] / paged [nb, bs, D_I], k_scale fp32 [rows] /
    [nb, bs], weights fp32 [T, H_I] (q scale folded in) -> fp32 [T, max(seqlens_k)]."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    from backends.reference.fp8_indexer_logits import quantize_indexer_inputs

    q8, k8, ks, w8 = quantize_indexer_inputs(randn(g, 2, 2, 32), randn(g, 5, 32), randn(g, 2, 2))
    return dict(q=q8, k_cache=k8, k_scale=ks, weights=w8, layout=SeqLayout.from_lengths([2], [5]))


DECL = OpDecl(
    name="fp8_indexer_logits",
    spec_section="7.4",
    signature=fp8_indexer_logits,
    dtype_axis=FP8,
    dtype_of=dtype_of("q"),
    validate=v8.check_fp8_indexer_logits,
    values=v8.values_fp8_indexer_logits,
    fake=indexer_logits_fake,
    sample=sample,
    sized=_sized.fp8_indexer("fp8_indexer_logits"),
    sharding="replicated",
    cache_arg="k_cache",
    quantities=INDEXER_QUANTITIES,
)
