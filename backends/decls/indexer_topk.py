"""indexer_topk (SPEC 2.2): the top-k causal keys by indexer logit, in the deterministic rule's order."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, INDEXER_QUANTITIES, dtype_of, indexer_topk_fake, scalar
from backends.decls.indexer_logits import sample as logits_sample
from backends.layout import SeqLayout


def indexer_topk(q: Tensor, k_cache: Tensor, weights: Tensor, layout: SeqLayout, topk: int) -> Tensor:
    """Inputs as indexer_logits -> int32 [T, topk] logical positions, -1 past the causal keys."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return logits_sample(g, dt, False) | {"topk": 64}  # 2100 keys > topk


DECL = OpDecl(
    name="indexer_topk",
    spec_section="2.2",
    signature=indexer_topk,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=v.check_indexer_topk,
    values=v.values_indexer_topk,
    fake=indexer_topk_fake,
    sample=sample,
    sized=_sized.indexer("indexer_topk"),
    sharding="replicated",
    cache_arg="k_cache",
    quantities={**INDEXER_QUANTITIES, "topk": scalar("topk")},
)
