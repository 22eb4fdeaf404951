"""FP8 indexer top-k (SPEC 7.5): the `topk` causal positions with the largest `fp8_indexer_logits`, in
the deterministic order of SPEC 2.3 (value desc, lower index first), -1 past the causal keys.

Scored per block of queries, so peak memory is O(QUERY_BLOCK * S_b), never the [T, S] logits.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.decls._common import FP8
from backends.layout import SeqLayout
from backends.reference._cache import causal_counts, keys_of_request
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


IMPL = OpImpl(fp8_indexer_topk, OpCaps(FP8, ("ragged", "paged"), tie_rule="lower_index"))
