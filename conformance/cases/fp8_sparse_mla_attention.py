"""Conformance cases for `fp8_sparse_mla_attention` (SPEC 7.7): GLM-5's absorbed MLA (H 64, d_qk 576,
d_v 512, top-2048 of 2.3-4.5K keys) over FlashMLA's 656-byte FP8 cache, ragged and paged (odd block
sizes 61, 13, shuffled), -1 and out-of-range indices, duplicates, all-invalid rows (out 0, lse -inf);
every unused byte of the cache is 0xFF (NaN codes, scales and RoPE), so a kernel that reads a row no
valid index names produces NaN.

Semantics: backends/reference/fp8_sparse_mla_attention.py (SPEC 7.7)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conformance.case import Case, Output
from conformance.cases._common import INT32_MAX, INT32_MIN, Subset, randint, randn, request_subset, tdtype
from conformance.cases._fp8 import mla_cache
from conformance.cases.sparse_mla_attention import GLM5_SM_SCALE, causal_indices

OUTPUTS = (Output("out", "attention"), Output("lse", "lse"))


def _case(id: str, build, **kw) -> Case:
    return Case("fp8_sparse_mla_attention", id, build, () if id.startswith("errors/") else OUTPUTS, **kw)


def mk(g, dt, q_lens: Sequence[int], k_lens: Sequence[int], topk: int, *, h=16, block_size=None):
    layout, cache = mla_cache(g, q_lens, k_lens, block_size=block_size)
    q = randn(g, sum(q_lens), h, 576).clamp(-1, 1).to(tdtype(dt))  # FlashMLA decode test: randn clamped
    return {
        "q": q,
        "kv_cache": cache,
        "indices": causal_indices(g, q_lens, k_lens, topk),
        "layout": layout,
        "sm_scale": GLM5_SM_SCALE,
        "d_v": 512,
        "return_lse": True,
    }


def _invalid(g, dt):
    a = mk(g, dt, [2, 1], [60, 45], 32, h=16)
    junk = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, 60, 61, 45, 1 << 20], dtype=torch.int32)
    slots = torch.rand(a["indices"].shape, generator=g) < 0.4
    a["indices"][slots] = junk[randint(g, 0, junk.numel() - 1, int(slots.sum()))]
    a["indices"][2] = -1  # one row with no valid key
    return a


def _duplicates(g, dt):
    a = mk(g, dt, [3], [40], 24)
    a["indices"][:, 12:] = a["indices"][:, :12]
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, dt, [2, 1], [20, 9], 8, h=2)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case("smoke/ragged_h4", lambda g, dt: mk(g, dt, [2, 1], [40, 9], 16, h=4), tags={"layout": "ragged"}),
    _case(
        "smoke/paged_bs16",
        lambda g, dt: mk(g, dt, [1, 2], [33, 20], 16, h=4, block_size=16),
        tags={"layout": "paged_bs16"},
    ),
    _case(
        "realistic/decode_mtp_paged_bs64_top2048",
        lambda g, dt: mk(g, dt, [1, 2], [4500, 2300], 2048, h=64, block_size=64),
        tags={"layout": "paged_bs64", "shape": "T3 H64 d576 top2048 S<=4500"},
    ),
    _case(
        "realistic/decode_ragged_top2048",
        lambda g, dt: mk(g, dt, [1, 1], [3000, 2500], 2048, h=64),
        tags={"layout": "ragged", "shape": "T2 H64 d576 top2048 S<=3000"},
    ),
    _case("adversarial/invalid_indices_everywhere", _invalid),
    _case("adversarial/duplicate_indices", _duplicates),
    _case("adversarial/paged_bs61_shuffled", lambda g, dt: mk(g, dt, [2, 1], [130, 70], 48, block_size=61)),
    _case("adversarial/paged_bs13_h20", lambda g, dt: mk(g, dt, [1, 1], [60, 27], 32, h=20, block_size=13)),
    _case("adversarial/zero_length_request", lambda g, dt: mk(g, dt, [1, 1], [0, 30], 16)),
    _case(
        "errors/kv_cache_bf16",
        _bad(kv_cache=lambda a: a["kv_cache"].bfloat16()),
        error=(ValueError, r"^kv_cache: expected dtype torch.uint8"),
    ),
    _case(
        "errors/kv_cache_655",
        _bad(kv_cache=lambda a: a["kv_cache"][:, :655]),
        error=(ValueError, r"^kv_cache: expected last dim 656"),
    ),
    _case("errors/q_width", _bad(q=lambda a: a["q"][..., :512]), error=(ValueError, r"^q: expected shape")),
    _case("errors/d_v_448", _bad(d_v=448), error=(ValueError, r"^d_v: expected 512")),
    _case(
        "errors/indices_int64",
        _bad(indices=lambda a: a["indices"].long()),
        error=(ValueError, r"^indices: expected dtype"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "indices"), "kv_cache")
