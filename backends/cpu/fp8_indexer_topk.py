"""cpu backend: fp8_indexer_topk (SPEC 7.5): the reference's logits bit for bit (`_fp8_index.exact_scores`
on its 64-query blocks over all of a request's keys, the keys decoded once per request instead of once
per block), selected by the cpu backend's exact top-k (`backends/cpu/topk.py`: torch.topk plus the
rule's checks) instead of two stable sorts per block. Same order as the reference, ties included.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FP8
from backends.cpu._cache import causal_counts
from backends.cpu._fp8_index import exact_scores, request_keys
from backends.cpu.topk import topk as select_topk
from backends.layout import SeqLayout

QUERY_BLOCK = 64  # the reference's: the head sums' fp64 rounding follows the einsum's shapes


@torch.no_grad()
def fp8_indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    layout: SeqLayout,
    topk: int,
) -> torch.Tensor:
    """int32 [T, topk] causal positions in the rule's order, -1 padded.
    Semantics: backends/reference/fp8_indexer_topk.py (SPEC 7.5)"""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        keys, ks = request_keys(k_cache, k_scale, layout, b, s, torch.float64)
        visible = causal_counts(q1 - q0, s)
        for a in range(q0, q1, QUERY_BLOCK):
            z = min(a + QUERY_BLOCK, q1)
            sc = exact_scores(q[a:z], keys, ks, weights[a:z])
            out[a:z] = select_topk(sc, topk, visible[a - q0 : z - q0])[1]
    return out


IMPL = OpImpl(
    fp8_indexer_topk,
    OpCaps(
        FP8,
        ("ragged", "paged"),
        notes={"logits": "the reference's fp64 einsums on its blocks (bitwise), so the order is its order"},
        run_to_run=True,
        batch_invariant=True,
        tie_rule="lower_index",
    ),
)
