"""Conformance cases for `indexer_logits` (SPEC 2.1): GLM-5 indexer heads (H_I=32, D_I=128) over
ragged and paged caches with decode (T_b=1), MTP (T_b=2..4) and prefill rows, ReLU zero plateaus,
negative head weights, zero-length requests, odd block sizes with shuffled block tables.

Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from backends.layout import SeqLayout
from conformance.case import Case, Output
from conformance.cases._common import Subset, kv_layout, randn, request_subset, strided, tdtype, transposed

OUTPUTS = (Output("logits", "indexer_logits"),)


def indexer_inputs(
    g,
    dt,
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    *,
    h_i=4,
    d_i=16,
    block_size=None,
    plateau: float | None = None,
    weights="mixed",
) -> dict:
    """q [T, H_I, D_I], a cache of k_lens keys, weights [T, H_I] fp32 with the model's
    H_I**-0.5 * D_I**-0.5 folded in. plateau=p: q >= 0 and a fraction 1-p of the keys <= 0, so those
    keys score exactly 0 for every head (the ReLU plateau: exact ties)."""
    keys = None
    if plateau is not None:

        def keys(b, n):
            k = randn(g, n, d_i).abs()
            dead = torch.rand(n, generator=g) >= plateau
            k[dead] = -k[dead]
            return k

    layout, cache = kv_layout(g, q_lens, k_lens, d_i, dt, block_size=block_size, keys=keys)
    t = sum(q_lens)
    q = randn(g, t, h_i, d_i)
    if plateau is not None:
        q = q.abs()
    w = randn(g, t, h_i) if weights == "mixed" else torch.rand(t, h_i, generator=g) + 0.1
    return {"q": q.to(tdtype(dt)), "k_cache": cache, "weights": w * (h_i**-0.5 * d_i**-0.5), "layout": layout}


def _case(id: str, build, *, paged=False, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("indexer_logits", id, build, dtypes=kw.pop("dtypes", ("float32", "bfloat16")), **kw)
    grads = ("q", "weights") if paged else ("q", "k_cache", "weights")
    # gradients at GLM-5 shapes cost more than the rest of the suite; smoke and adversarial cover them
    return Case(
        "indexer_logits", id, build, OUTPUTS, grad_args=() if id.startswith("realistic/") else grads, **kw
    )


def _noncontig(g, dt):
    a = indexer_inputs(g, dt, [3, 2], [40, 9])
    a["q"] = transposed(a["q"])
    a["weights"] = strided(a["weights"])
    a["k_cache"] = strided(a["k_cache"])
    return a


def _paged_shuffled(bs, g, dt):
    return indexer_inputs(g, dt, [2, 1, 1], [130, 61, 1], block_size=bs)


def _bad(**over):
    def build(g, dt):
        a = indexer_inputs(g, dt, [2, 1], [5, 9])
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


def _layout(cu_q, sk, **kw):
    return SeqLayout(
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(sk, dtype=torch.int32),
        **{k: torch.tensor(v, dtype=torch.int32) for k, v in kw.items()},
    )


_REAL = {"h_i": 32, "d_i": 128}
CASES = [
    _case("smoke/ragged_b2", lambda g, dt: indexer_inputs(g, dt, [2, 1], [5, 9]), tags={"layout": "ragged"}),
    _case(
        "smoke/paged_bs4",
        lambda g, dt: indexer_inputs(g, dt, [2, 1], [5, 9], block_size=4),
        paged=True,
        tags={"layout": "paged_bs4"},
    ),
    _case(
        "realistic/decode_mtp_ragged_s4500",
        lambda g, dt: indexer_inputs(g, dt, [1, 3, 4], [4500, 3000, 2100], **_REAL),
        tags={"layout": "ragged", "shape": "T8 H_I32 D_I128 S<=4500"},
    ),
    _case(
        "realistic/mtp_paged_bs64_s4200",
        lambda g, dt: indexer_inputs(g, dt, [2, 4, 1], [4200, 2500, 3333], block_size=64, **_REAL),
        paged=True,
        tags={"layout": "paged_bs64", "shape": "T7 H_I32 D_I128 S<=4200"},
    ),
    _case(
        "adversarial/relu_zero_plateau",
        lambda g, dt: indexer_inputs(g, dt, [3, 1], [90, 40], plateau=0.1, weights="positive"),
    ),
    _case(
        "adversarial/negative_weights_plateau",
        lambda g, dt: indexer_inputs(g, dt, [2, 2], [50, 30], plateau=0.3),
    ),
    _case(
        "adversarial/zero_length_requests",
        lambda g, dt: indexer_inputs(g, dt, [0, 2, 1, 3, 0], [6, 0, 5, 7, 0]),
    ),
    _case("adversarial/more_queries_than_keys", lambda g, dt: indexer_inputs(g, dt, [5, 1], [2, 3])),
    _case("adversarial/prefill_t_eq_s", lambda g, dt: indexer_inputs(g, dt, [24, 17], [24, 17])),
    *[
        _case(
            f"adversarial/paged_bs{bs}_shuffled",
            partial(_paged_shuffled, bs),
            paged=True,
            tags={"layout": f"paged_bs{bs}"},
        )
        for bs in (1, 13, 61)
    ],
    _case(
        "adversarial/noncontig_views", _noncontig, tags={"layout": "transposed q, strided weights and cache"}
    ),
    _case(
        "errors/q_int", _bad(q=lambda a: a["q"].to(torch.int32)), error=(ValueError, r"^q: expected dtype")
    ),
    _case(
        "errors/k_cache_dtype",
        _bad(k_cache=lambda a: a["k_cache"].double()),
        error=(ValueError, r"^k_cache: expected dtype"),
        dtypes=("float32",),
    ),
    _case(
        "errors/weights_bf16",
        _bad(weights=lambda a: a["weights"].bfloat16()),
        error=(ValueError, r"^weights: expected dtype torch.float32"),
    ),
    _case(
        "errors/weights_other_device",
        _bad(weights=lambda a: a["weights"].to("meta")),
        error=(ValueError, r"^weights: expected device"),
    ),
    _case(
        "errors/weights_shape",
        _bad(weights=lambda a: a["weights"][:, :2]),
        error=(ValueError, r"^weights: expected shape"),
    ),
    _case(
        "errors/k_cache_width",
        _bad(k_cache=lambda a: a["k_cache"][:, :8]),
        error=(ValueError, r"^k_cache: expected last dim"),
    ),
    _case(
        "errors/cu_seqlens_q_not_t",
        _bad(layout=_layout([0, 2, 4], [5, 9], cu_seqlens_k=[3, 11, 23])),
        error=(ValueError, r"^layout.cu_seqlens_q: expected last offset == number of query tokens"),
    ),
    _case(
        "errors/seqlens_k_negative",
        _bad(layout=_layout([0, 2, 3], [-1, 9], cu_seqlens_k=[3, 11, 23])),
        error=(ValueError, r"^layout.seqlens_k: expected non-negative"),
    ),
    _case(
        "errors/cu_seqlens_k_past_cache",
        _bad(layout=_layout([0, 2, 3], [5, 9], cu_seqlens_k=[3, 11, 99])),
        error=(ValueError, r"^layout.cu_seqlens_k: expected last offset <= cache rows"),
    ),
    _case(
        "errors/paged_layout_ragged_cache",
        _bad(layout=_layout([0, 2, 3], [5, 9], block_table=[[0, 1, 2], [3, 4, 5]])),
        error=(ValueError, r"^k_cache: expected a paged cache"),
    ),
    _case(
        "errors/block_id_out_of_range",
        lambda g, dt: (
            _bad()(g, dt)
            | {
                "k_cache": torch.zeros(4, 4, 16, dtype=tdtype(dt)),
                "layout": _layout([0, 2, 3], [5, 9], block_table=[[0, 1, 0], [2, 3, 4]]),
            }
        ),
        error=(ValueError, r"^layout.block_table: expected request 1: block ids in \[0, 4\)"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "weights"), "k_cache", width_out=True)
