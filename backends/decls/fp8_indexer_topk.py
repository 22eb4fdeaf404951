"""fp8_indexer_topk (SPEC 7.5): the top-k causal keys by FP8 indexer logit."""

from __future__ import annotations

from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FP8, dtype_of, scalar
from backends.decls.fp8_indexer_logits import sample as logits_sample
from backends.layout import SeqLayout
from backends.reference.indexer_logits import QUANTITIES as INDEXER_QUANTITIES
from backends.reference.indexer_topk import fake as indexer_topk_fake


def fp8_indexer_topk(
    q: Tensor, k_cache: Tensor, k_scale: Tensor, weights: Tensor, layout: SeqLayout, topk: int
) -> Tensor:
    """Inputs as fp8_indexer_logits -> int32 [T, topk], rule order, -1 padded."""


DECL = OpDecl(
    name="fp8_indexer_topk",
    spec_section="7.5",
    signature=fp8_indexer_topk,
    dtype_axis=FP8,
    dtype_of=dtype_of("q"),
    validate=v8.check_fp8_indexer_topk,
    values=v8.values_fp8_indexer_topk,
    fake=indexer_topk_fake,
    sample=lambda g, dt, grad: logits_sample(g, dt, grad) | {"topk": 3},
    sized=_sized.fp8_indexer("fp8_indexer_topk"),
    sharding="replicated",
    cache_arg="k_cache",
    quantities={**INDEXER_QUANTITIES, "topk": scalar("topk")},
)
