"""Conformance cases for `indexer_topk` (SPEC 2.2): top-2048 over 4-5K keys per request (more keys
than topk, so sparse differs from dense), decode and MTP rows, ReLU plateaus with fewer than topk
positive keys (exact ties: lower index first), duplicated keys, rows with fewer causal keys than topk,
zero-length requests, paged caches with odd block sizes and shuffled block tables.

Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
"""

from __future__ import annotations

import torch

from backends.formats import INDEX_SCALE_BYTES, write_index_cache
from conformance.case import Case, Output
from conformance.cases._common import Subset, kv_layout, near_ties, randn, request_subset, tdtype, transposed
from conformance.cases.indexer_logits import indexer_inputs

OUTPUTS = (Output("indices", "indexer_topk_indices"),)
#: on the FP8 indexer cache (SPEC 7.8): fp8_indexer_topk's check on the inputs the backend quantizes
FP8_OUTPUTS = (Output("indices", "fp8_cache_indexer_topk"),)


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("indexer_topk", id, build, dtypes=("float32",), **kw)
    return Case("indexer_topk", id, build, kw.pop("outputs", OUTPUTS), **kw)


def mk(q_lens, k_lens, topk, **kw):
    return lambda g, dt: indexer_inputs(g, dt, q_lens, k_lens, **kw) | {"topk": topk}


def fp8_cache(build):
    """The same inputs with the keys in the FP8 indexer cache (uint8 [.., D_I + 4], vLLM's block layout;
    unused rows NaN as in the float cache): the cache kind fp8_ragged / fp8_paged (SPEC 7.8)."""

    def make(g, dt):
        a = build(g, dt)
        k = a["k_cache"]
        cache = torch.zeros(*k.shape[:-1], k.shape[-1] + INDEX_SCALE_BYTES, dtype=torch.uint8)
        write_index_cache(cache, torch.arange(k.shape[:-1].numel()), k.reshape(-1, k.shape[-1]).float())
        return a | {"k_cache": cache}

    return make


def _duplicate_keys(g, dt):
    # every key repeated at 3 positions: exact ties among positive scores
    layout, cache = kv_layout(
        g,
        [3, 2],
        [96, 60],
        16,
        dt,
        block_size=7,
        keys=lambda b, n: randn(g, (n + 2) // 3, 16).repeat_interleave(3, 0)[:n],
    )
    return {
        "q": randn(g, 5, 4, 16).to(tdtype(dt)),
        "k_cache": cache,
        "weights": torch.rand(5, 4, generator=g),
        "layout": layout,
        "topk": 24,
    }


def _near_ties(g, dt):
    layout, cache = kv_layout(
        g, [2, 2], [200, 150], 16, dt, keys=lambda b, n: near_ties(g, (n, 16), dt).float()
    )
    return {
        "q": torch.ones(4, 4, 16, dtype=tdtype(dt)),
        "k_cache": cache,
        "weights": torch.full((4, 4), 1 / 8),
        "layout": layout,
        "topk": 40,
    }


def _noncontig(g, dt):
    a = indexer_inputs(g, dt, [2, 3], [70, 45], block_size=16)
    a["q"] = transposed(a["q"])
    return a | {"topk": 32}


_REAL = {"h_i": 32, "d_i": 128}
CASES = [
    _case("smoke/ragged_s20_k8", mk([2, 1], [20, 9], 8), tags={"layout": "ragged", "shape": "T3 S<=20 k8"}),
    _case("smoke/paged_bs5_k8", mk([1, 2], [13, 21], 8, block_size=5), tags={"layout": "paged_bs5"}),
    _case(
        "realistic/decode_mtp_ragged_s4500_k2048",
        mk([1, 2, 4], [4500, 3000, 2600], 2048, **_REAL),
        tags={"layout": "ragged", "shape": "T7 H_I32 D_I128 S<=4500 k2048"},
    ),
    _case(
        "realistic/mtp_paged_bs64_s5000_k2048",
        mk([4, 1, 3], [4113, 2100, 5000], 2048, block_size=64, **_REAL),
        tags={"layout": "paged_bs64", "shape": "T8 H_I32 D_I128 S<=5000 k2048"},
    ),
    _case(
        "adversarial/ties_relu_plateau_ragged", mk([3, 2], [300, 150], 64, plateau=0.1, weights="positive")
    ),
    *[
        _case(
            f"adversarial/ties_relu_plateau_paged_bs{bs}",
            mk([3, 2], [300, 150], 64, block_size=bs, plateau=0.1, weights="positive"),
            tags={"layout": f"paged_bs{bs}"},
        )
        for bs in (1, 13, 61)
    ],
    _case("adversarial/negative_weights_plateau", mk([2, 2], [120, 90], 32, plateau=0.3)),
    _case("adversarial/ties_duplicate_keys_paged_bs7", _duplicate_keys, tags={"layout": "paged_bs7"}),
    _case("adversarial/near_ties_low_bits", _near_ties),
    _case("adversarial/fewer_causal_keys_than_topk", mk([6, 1], [20, 30], 64)),
    _case("adversarial/zero_length_requests", mk([0, 2, 1, 3, 0], [70, 0, 75, 80, 0], 32)),
    _case("adversarial/topk1", mk([2, 2], [50, 70], 1)),
    _case("adversarial/prefill_chunk_crosses_topk", mk([40], [140], 100)),
    _case("adversarial/noncontig_q_paged_bs16", _noncontig, tags={"layout": "transposed q, paged_bs16"}),
    *[
        _case(
            f"smoke/fp8_cache_{name}",
            fp8_cache(mk(*lens, topk, d_i=128, **kw)),
            outputs=FP8_OUTPUTS,
            tags={"layout": f"fp8_{name}", "cache": "FP8 indexer cache (D_I e4m3 + fp32 scale per key)"},
        )
        for name, lens, topk, kw in (
            ("ragged_s90_k16", ([2, 1], [90, 41]), 16, {}),
            ("paged_bs16_s300_k64", ([1, 3], [300, 133]), 64, {"block_size": 16}),
        )
    ],
    _case("errors/topk_zero", mk([2, 1], [20, 9], 0), error=(ValueError, r"^topk: expected an int >= 1")),
    _case("errors/topk_float", mk([2, 1], [20, 9], 8.0), error=(ValueError, r"^topk: expected an int")),
    _case(
        "errors/weights_shape",
        lambda g, dt: mk([2, 1], [20, 9], 8)(g, dt) | {"weights": torch.ones(3, 5)},
        error=(ValueError, r"^weights: expected shape"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "weights"), "k_cache")
