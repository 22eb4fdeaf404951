"""Conformance cases for `sparse_mla_attention` (SPEC 2.4): GLM-5's absorbed MLA (H=64, d_qk=576,
d_v=512, top-2048 of 3-5K keys, sm_scale 0.0625) for decode and MTP rows, NaN in every cache row no
valid index names (a kernel must never read them), -1 and out-of-range indices over the whole int32
range, duplicates, empty rows (out 0, lse -inf), zero-length requests, odd block sizes.

Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from backends.cache_layout import MLACacheLayout, write_rows
from backends.layout import SeqLayout
from conformance.case import Case, Output
from conformance.cases._common import (
    INT32_MAX,
    INT32_MIN,
    NAN,
    Subset,
    causal_count,
    kv_layout,
    perm,
    randint,
    randn,
    request_subset,
    strided,
    tdtype,
    transposed,
)

OUTPUTS = (Output("out", "attention"), Output("lse", "lse"))
GLM5_SM_SCALE = (192 + 64) ** -0.5


def causal_indices(g, q_lens: Sequence[int], k_lens: Sequence[int], topk: int) -> torch.Tensor:
    """int32 [T, topk]: for each query a random-order subset of its causal keys (as an indexer would
    pick), -1 past them."""
    rows = []
    for t_b, s_b in zip(q_lens, k_lens, strict=True):
        for i in range(t_b):
            n = causal_count(t_b, s_b, i)
            pick = perm(g, n)[:topk] if n else torch.empty(0, dtype=torch.int64)
            rows.append(torch.cat([pick, torch.full((topk - pick.numel(),), -1)]))
    return torch.stack(rows).to(torch.int32) if rows else torch.empty(0, topk, dtype=torch.int32)


def attn_inputs(
    g, dt, q_lens, k_lens, topk, *, h=4, d_qk=48, d_v=32, block_size=None, q_scale=1.0, sm_scale=None
) -> dict:
    layout, cache = kv_layout(g, q_lens, k_lens, d_qk, dt, block_size=block_size)
    q = randn(g, sum(q_lens), h, d_qk, scale=q_scale).to(tdtype(dt))
    return {
        "q": q,
        "kv_cache": cache,
        "indices": causal_indices(g, q_lens, k_lens, topk),
        "layout": layout,
        "sm_scale": sm_scale if sm_scale is not None else d_qk**-0.5,
        "d_v": d_v,
    }


def nan_unindexed(a: dict) -> dict:
    """Set every cache row that no valid index names to NaN."""
    cache, layout, idx = a["kv_cache"], a["layout"], a["indices"].to(torch.int64)
    flat = cache.reshape(-1, cache.shape[-1])
    keep = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        pos = idx[q0:q1][(idx[q0:q1] >= 0) & (idx[q0:q1] < s)]
        keep[layout.physical_rows(b, pos, cache)] = True
    flat[~keep] = NAN
    return a


def _invalid(g, dt):
    a = attn_inputs(g, dt, [3, 2], [60, 45], 24)
    junk = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, 60, 61, 45, 1 << 20], dtype=torch.int32)
    slots = torch.rand(a["indices"].shape, generator=g) < 0.4
    a["indices"][slots] = junk[randint(g, 0, len(junk) - 1, int(slots.sum()))]
    return nan_unindexed(a)


def _invalid_paged(g, dt):
    a = attn_inputs(g, dt, [2, 1], [2200, 2049], 128, h=4, d_qk=576, d_v=512, block_size=64)
    junk = torch.tensor([-1, INT32_MIN, INT32_MAX, 2200, 2049, 1 << 20], dtype=torch.int32)
    slots = torch.rand(a["indices"].shape, generator=g) < 0.3
    a["indices"][slots] = junk[randint(g, 0, len(junk) - 1, int(slots.sum()))]
    a["indices"][2] = -1  # a row with nothing to attend to: out 0
    return nan_unindexed(a)


def _duplicates(g, dt):
    a = attn_inputs(g, dt, [2, 2], [30, 40], 16)
    a["indices"][:, 8:] = a["indices"][:, :8]
    return a


def _empty_rows(g, dt):
    a = attn_inputs(g, dt, [3, 2], [30, 20], 12)
    a["indices"][0] = -1
    a["indices"][3] = torch.tensor([20, 21, INT32_MAX, -5] * 3, dtype=torch.int32)  # all out of range
    return a


def _noncontig(g, dt):
    a = attn_inputs(g, dt, [2, 3], [50, 40], 16)
    a["q"] = transposed(a["q"])
    a["indices"] = strided(a["indices"])
    return a


def _split_pools(build):
    """The same inputs with the paged cache as split pools (backends/cache_layout.py): latent
    [nb, bs, 1, 512] and rope [nb, bs, 1, 64] over one buffer, as a backend declaring them gets them."""

    def make(g, dt):
        a = build(g, dt)
        kv = a["kv_cache"]
        pools = MLACacheLayout(split=(512, kv.shape[-1] - 512)).view(torch.empty_like(kv), kv.shape[1])
        write_rows(pools, torch.arange(kv.shape[:2].numel()), kv.reshape(-1, kv.shape[-1]))
        return a | {"kv_cache": pools}

    return make


def _fp8_rows(q_lens, k_lens, topk, *, h=16, block_size=None, lse=True):
    """q [T, H, 576] and FlashMLA's 656-byte FP8 rows (unused bytes 0xFF: NaN codes, scales, RoPE): the
    cache kind fp8_ragged / fp8_paged, served by the backend's FP8 kernel (SPEC 7.8)."""
    from conformance.cases._fp8 import mla_cache

    def make(g, dt):
        layout, cache = mla_cache(g, q_lens, k_lens, block_size=block_size)
        q = randn(g, sum(q_lens), h, 576).clamp(-1, 1).to(tdtype(dt))
        idx = causal_indices(g, q_lens, k_lens, topk)
        return dict(
            q=q, kv_cache=cache, indices=idx, layout=layout, sm_scale=GLM5_SM_SCALE, d_v=512, return_lse=lse
        )

    return make


def _no_lse(build):
    """The inference form: `return_lse=False`, lse None on every backend (paged caches, >= 2048 keys)."""
    return lambda g, dt: build(g, dt) | {"return_lse": False}


def _nan_paged(bs, g, dt):
    return nan_unindexed(attn_inputs(g, dt, [2, 1, 1], [130, 61, 1], 32, block_size=bs))


def _bad(**over):
    def build(g, dt):
        a = attn_inputs(g, dt, [2, 1], [20, 9], 8)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


def _case(id: str, build, *, paged=False, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("sparse_mla_attention", id, build, dtypes=("float32",), **kw)
    return Case(
        "sparse_mla_attention",
        id,
        build,
        OUTPUTS,
        grad_args=kw.pop("grad_args", ("q",) if paged else ("q", "kv_cache")),
        **kw,
    )


_REAL = {"h": 64, "d_qk": 576, "d_v": 512, "sm_scale": GLM5_SM_SCALE}
CASES = [
    _case(
        "smoke/ragged_b2_topk16",
        lambda g, dt: attn_inputs(g, dt, [2, 1], [40, 17], 16),
        tags={"layout": "ragged", "shape": "T3 H4 d_qk48 topk16"},
    ),
    _case(
        "smoke/paged_bs8_topk16",
        lambda g, dt: attn_inputs(g, dt, [1, 2], [33, 21], 16, block_size=8),
        paged=True,
        tags={"layout": "paged_bs8"},
    ),
    _case(
        "realistic/decode_mtp_ragged_s4500_topk2048",
        lambda g, dt: nan_unindexed(attn_inputs(g, dt, [1, 3], [4500, 3100], 2048, **_REAL)),
        grad_args=(),
        tags={"layout": "ragged", "shape": "T4 H64 d_qk576 d_v512 topk2048 S<=4500"},
    ),
    _case(
        "realistic/mtp_paged_bs64_s3600_topk2048",
        lambda g, dt: attn_inputs(g, dt, [2, 1, 1], [3600, 2048, 2500], 2048, block_size=64, **_REAL),
        paged=True,
        grad_args=(),
        tags={"layout": "paged_bs64", "shape": "T4 H64 d_qk576 d_v512 topk2048 S<=3600"},
    ),
    _case(
        "smoke/paged_bs16_s2304_topk64_no_lse",
        _no_lse(
            lambda g, dt: attn_inputs(g, dt, [1, 2], [2304, 2100], 64, h=4, d_qk=576, d_v=512, block_size=16)
        ),
        paged=True,
        grad_args=(),
        tags={"layout": "paged_bs16", "shape": "T3 H4 d_qk576 d_v512 topk64 S<=2304 return_lse=False"},
    ),
    _case(
        "realistic/decode_paged_bs128_s4096_topk2048_no_lse",
        _no_lse(
            lambda g, dt: nan_unindexed(
                attn_inputs(g, dt, [1, 1, 2], [4096, 2500, 2048], 2048, block_size=128, **_REAL)
            )
        ),
        paged=True,
        grad_args=(),
        tags={"layout": "paged_bs128", "shape": "T4 H64 d_qk576 d_v512 topk2048 S<=4096 return_lse=False"},
    ),
    _case(
        "adversarial/invalid_indices_paged_bs64_s2200_no_lse",
        _no_lse(lambda g, dt: _invalid_paged(g, dt)),
        paged=True,
        tags={"layout": "paged_bs64", "shape": "T3 H4 d_qk576 topk128 junk indices return_lse=False"},
    ),
    _case(
        "adversarial/nan_unindexed_rows",
        lambda g, dt: nan_unindexed(attn_inputs(g, dt, [3, 2], [80, 50], 24)),
    ),
    _case("adversarial/invalid_indices_int32_range", _invalid),
    _case("adversarial/duplicate_indices", _duplicates),
    _case("adversarial/empty_rows", _empty_rows),
    _case(
        "adversarial/zero_length_requests",
        lambda g, dt: nan_unindexed(attn_inputs(g, dt, [0, 2, 1, 0], [9, 0, 30, 0], 12)),
    ),
    _case("adversarial/topk_gt_keys", lambda g, dt: attn_inputs(g, dt, [2, 1], [7, 5], 64)),
    _case("adversarial/large_logits", lambda g, dt: attn_inputs(g, dt, [2, 2], [40, 40], 16, q_scale=20.0)),
    *[
        _case(
            f"adversarial/nan_unindexed_paged_bs{bs}_shuffled",
            partial(_nan_paged, bs),
            paged=True,
            tags={"layout": f"paged_bs{bs}"},
        )
        for bs in (1, 13, 61)
    ],
    *[
        _case(
            f"smoke/split_pools_bs16_s300_topk64{'_no_lse' if not lse else ''}",
            _split_pools(
                lambda g, dt, lse=lse: (
                    nan_unindexed(
                        attn_inputs(g, dt, [2, 1], [300, 129], 64, h=4, d_qk=576, d_v=512, block_size=16)
                    )
                    | {"return_lse": lse}
                )
            ),
            paged=True,
            grad_args=(),  # split pools are an inference cache
            tags={"layout": "split_pools_bs16", "shape": f"T3 H4 d_qk576 d_v512 topk64 return_lse={lse}"},
        )
        for lse in (False, True)
    ],
    _case(
        "smoke/fp8_cache_ragged_h4_topk16",
        _fp8_rows([2, 1], [40, 9], 16, h=4),
        grad_args=(),  # an inference cache
        tags={"layout": "fp8_ragged", "cache": "656-byte FP8 rows"},
    ),
    _case(
        "realistic/fp8_cache_paged_bs64_h64_top2048_no_lse",
        _fp8_rows([1, 2], [4500, 2300], 2048, h=64, block_size=64, lse=False),
        paged=True,
        grad_args=(),
        tags={"layout": "fp8_paged_bs64", "cache": "656-byte FP8 rows", "shape": "T3 H64 top2048 S<=4500"},
    ),
    _case(
        "errors/fp8_rows_d_v",
        lambda g, dt: _fp8_rows([2, 1], [20, 9], 8, h=2)(g, dt) | {"d_v": 448},
        error=(ValueError, r"^d_v: expected 512 \(the latent width of a kv_cache of FP8 rows\)"),
    ),
    _case("adversarial/noncontig_views", _noncontig, tags={"layout": "transposed q, strided indices"}),
    _case(
        "errors/indices_int64",
        _bad(indices=lambda a: a["indices"].long()),
        error=(ValueError, r"^indices: expected dtype"),
    ),
    _case(
        "errors/indices_rows",
        _bad(indices=lambda a: a["indices"][:2]),
        error=(ValueError, r"^indices: expected shape"),
    ),
    _case(
        "errors/indices_other_device",
        _bad(indices=lambda a: a["indices"].to("meta")),
        error=(ValueError, r"^indices: expected device"),
    ),
    _case("errors/d_v_gt_d_qk", _bad(d_v=49), error=(ValueError, r"^d_v: expected <= d_qk")),
    _case(
        "errors/sm_scale_nan",
        _bad(sm_scale=float("nan")),
        error=(ValueError, r"^sm_scale: expected a finite"),
    ),
    _case(
        "errors/kv_cache_dtype",
        _bad(kv_cache=lambda a: a["kv_cache"].half()),
        error=(ValueError, r"^kv_cache: expected dtype"),
    ),
    _case("errors/q_2d", _bad(q=lambda a: a["q"][:, 0]), error=(ValueError, r"^q: expected 3 dims")),
    _case(
        "errors/layout_not_seqlayout",
        _bad(layout=(0, 2, 3)),
        error=(ValueError, r"^layout: expected a backends.SeqLayout"),
    ),
    _case(
        "errors/cu_seqlens_q_decreasing",
        _bad(
            layout=lambda a: SeqLayout(
                torch.tensor([0, 3, 2], dtype=torch.int32),
                a["layout"].seqlens_k,
                cu_seqlens_k=a["layout"].cu_seqlens_k,
            )
        ),
        error=(ValueError, r"^layout.cu_seqlens_q: expected non-decreasing"),
    ),
]


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "indices"), "kv_cache")
