"""FP8 indexer top-k (SPEC 7.5): the `topk` causal positions with the largest `fp8_indexer_logits`, in
the deterministic order of SPEC 2.3 (value desc, lower index first), -1 past the causal keys.

Scored per block of queries, so peak memory is O(QUERY_BLOCK * S_b), never the [T, S] logits. This
module is the op's declaration too (`DECL`: the function below is the signature; validators, fake, sized
builder, sample).
"""

from __future__ import annotations

import torch

from backends.argcheck import check_topk_width
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.layout import SeqLayout
from backends.reference import fp8_indexer_logits as logits
from backends.reference._cache import causal_counts, keys_of_request
from backends.reference._common import FP8, dtype_of, scalar
from backends.reference.fp8_indexer_logits import fp8_score_block
from backends.reference.topk import rule_order

QUERY_BLOCK = 64


@reference_op("fp8_indexer_topk")
@torch.no_grad()
def fp8_indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    layout: SeqLayout,
    topk: int,
) -> torch.Tensor:
    """Inputs as fp8_indexer_logits -> int32 [T, topk], rule order, -1 padded."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    scales = k_scale.unsqueeze(-1)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        keys = keys_of_request(k_cache, layout, b, s)
        ks = keys_of_request(scales, layout, b, s)[:, 0]
        visible = causal_counts(q1 - q0, s)
        for a in range(q0, q1, QUERY_BLOCK):
            z = min(a + QUERY_BLOCK, q1)
            sc = fp8_score_block(q[a:z], keys, ks, weights[a:z])
            ok = torch.arange(s)[None, :] < visible[a - q0 : z - q0, None]
            order = rule_order(sc, ok)[:, :topk]
            res = torch.where(ok.gather(1, order), order, -1).to(torch.int32)
            out[a:z, : res.shape[1]] = res
    return out


def check(q, k_cache, k_scale, weights, layout, topk) -> None:
    logits.check(q, k_cache, k_scale, weights, layout)
    check_topk_width("topk", topk, k_cache.shape[:-1].numel(), "the cache's keys")


def values(q, k_cache, k_scale, weights, layout, topk) -> None:
    logits.values(q, k_cache, k_scale, weights, layout)


def fake(a: dict) -> torch.Tensor:
    return a["q"].new_empty((a["q"].shape[0], a["topk"]), dtype=torch.int32)


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    topk = v if quantity == "topk" else 64
    return logits.sized(g, dt, quantity, v, topk) | {"topk": topk}


DECL = OpDecl(
    name="fp8_indexer_topk",
    spec_section="7.5",
    signature=fp8_indexer_topk,
    dtype_axis=FP8,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=fake,
    sample=lambda g, dt, grad: logits.sample(g, dt, grad) | {"topk": 3},
    sized=sized,
    sharding="replicated",
    cache_arg="k_cache",
    quantities={**logits.QUANTITIES, "topk": scalar("topk")},
)
IMPL = OpImpl(fp8_indexer_topk, OpCaps(FP8, ("ragged", "paged"), tie_rule="lower_index"))
