"""Indexer top-k (SPEC 2.2): the `topk` causal positions with the largest indexer logits, in the
deterministic order of SPEC 2.3, -1 past the causal keys.

Scored in key chunks and merged into a running top-k, so peak extra memory is
O(tq * (topk + chunk) + tq * H_I * chunk) per query block, never the [T, S] logits.
`indexer_topk_naive` is the one-line definition; tests check the two agree. This module is the op's
declaration too (`DECL`: the function below is the signature; validators, fake, sized builder, sample).
"""

from __future__ import annotations

import torch

from backends.argcheck import check_topk_width
from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.layout import SeqLayout
from backends.reference import indexer_logits as logits
from backends.reference._cache import causal_counts, keys_of_request
from backends.reference._common import FLOATS, dtype_of, scalar
from backends.reference.fp8_indexer_logits import on_fp8_index_cache
from backends.reference.fp8_indexer_topk import IMPL as FP8_TOPK
from backends.reference.indexer_logits import indexer_logits, score_block
from backends.reference.topk import rule_order
from backends.reference.topk import topk as rule_topk

QUERY_BLOCK = 128
KEY_CHUNK = 2048


def indexer_topk_naive(q, k_cache, weights, layout: SeqLayout, topk: int) -> torch.Tensor:
    """Materialises [T, S]; only for tests and small inputs."""
    logits = indexer_logits(q, k_cache, weights, layout)  # [T, S_max]
    lengths = torch.zeros(q.shape[0], dtype=torch.int64)
    for q0, q1, s in layout.request_bounds():
        lengths[q0:q1] = causal_counts(q1 - q0, s)
    return rule_topk(logits, topk, lengths)[1]


@reference_op("indexer_topk")
@torch.no_grad()
def indexer_topk(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout, topk: int
) -> torch.Tensor:
    """Inputs as indexer_logits -> int32 [T, topk] logical positions, -1 past the causal keys."""
    t = q.shape[0]  # q: [T, H_I, D_I]
    out = torch.full((t, topk), -1, dtype=torch.int32)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        keys = keys_of_request(k_cache, layout, b, s)  # [S_b, D_I]
        visible = causal_counts(q1 - q0, s)  # [T_b]
        for a in range(q0, q1, QUERY_BLOCK):
            z = min(a + QUERY_BLOCK, q1)
            out[a:z] = _block_topk(q[a:z], keys, weights[a:z], visible[a - q0 : z - q0], topk)
    return out


def _block_topk(q, keys, weights, visible, topk) -> torch.Tensor:
    """Running top-k over key chunks for one query block; visible [tq] = causal key count per row."""
    tq = q.shape[0]
    best_val = torch.empty(tq, 0)  # sorted by the rule
    best_idx = torch.empty(tq, 0, dtype=torch.int64)
    best_ok = torch.empty(tq, 0, dtype=torch.bool)
    for c0 in range(0, int(visible.max()), KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, keys.shape[0])
        val = torch.cat([best_val, score_block(q, keys[c0:c1], weights)], dim=1)
        idx = torch.cat([best_idx, torch.arange(c0, c1).expand(tq, -1)], dim=1)
        ok = torch.cat([best_ok, idx[:, best_idx.shape[1] :] < visible[:, None]], dim=1)
        # running entries all have lower indices than this chunk's, so ties stay index-ordered
        order = rule_order(val, ok)[:, :topk]
        best_val, best_idx, best_ok = val.gather(1, order), idx.gather(1, order), ok.gather(1, order)
    res = torch.where(best_ok, best_idx, -1).to(torch.int32)
    return torch.nn.functional.pad(res, (0, topk - res.shape[1]), value=-1)


def check(q, k_cache, weights, layout, topk) -> None:
    logits.check(q, k_cache, weights, layout)
    check_topk_width("topk", topk, k_cache.shape[:-1].numel(), "the cache's keys")


def values(q, k_cache, weights, layout, topk) -> None:
    logits.values(q, k_cache, weights, layout)


def fake(a: dict) -> torch.Tensor:
    return a["q"].new_empty((a["q"].shape[0], a["topk"]), dtype=torch.int32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return logits.sample(g, dt, False) | {"topk": 64}  # 2100 keys > topk


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    topk = v if quantity == "topk" else 64
    return logits.sized(g, dt, quantity, v, topk) | {"topk": topk}


DECL = OpDecl(
    name="indexer_topk",
    spec_section="2.2",
    signature=indexer_topk,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=fake,
    sample=sample,
    sized=sized,
    sharding="replicated",
    cache_arg="k_cache",
    quantities={**logits.QUANTITIES, "topk": scalar("topk")},
)
IMPL = by_kind(
    OpImpl(indexer_topk, OpCaps(FLOATS, ("ragged", "paged"), tie_rule="lower_index", layout_invariant=True)),
    dict.fromkeys(FP8_KINDS, on_fp8_index_cache(FP8_TOPK)),  # the FP8 indexer cache (SPEC 7.8)
)
