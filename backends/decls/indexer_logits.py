"""indexer_logits (SPEC 2.1): the lightning indexer's scores of every causal key."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import (
    FLOATS,
    INDEXER_QUANTITIES,
    LONG_BLOCKS,
    dtype_of,
    indexer_logits_fake,
    long_layout,
    randn,
)
from backends.layout import SeqLayout


def indexer_logits(q: Tensor, k_cache: Tensor, weights: Tensor, layout: SeqLayout) -> Tensor:
    """q [T, H_I, D_I] float, k_cache ragged [rows, D_I] / paged [nb, bs, D_I], weights fp32 [T, H_I]
    -> fp32 [T, max(seqlens_k)], -inf where not causal."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        q=randn(g, 4, 2, 16, dtype=dt, grad=grad),
        k_cache=randn(g, LONG_BLOCKS, 64, 16, dtype=dt, grad=grad),
        weights=randn(g, 4, 2, grad=grad),
        layout=long_layout(),
    )


DECL = OpDecl(
    name="indexer_logits",
    spec_section="2.1",
    signature=indexer_logits,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=v.check_indexer_logits,
    values=v.values_indexer_logits,
    fake=indexer_logits_fake,
    sample=sample,
    sized=_sized.indexer("indexer_logits"),
    sharding="replicated",
    cache_arg="k_cache",
    grad_args=("q", "k_cache", "weights"),
    quantities=INDEXER_QUANTITIES,
)
