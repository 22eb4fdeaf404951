"""Breaking one adapter conversion makes the conformance runner fail the case (and the intact adapter
passes it): the emulations are worth something only if they catch adapter bugs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.ascend import _adapters as ad
from conformance import cases
from conformance.cases.indexer_logits import indexer_inputs
from conformance.cases.sparse_mla_attention import attn_inputs
from conformance.result import PASS
from conformance.runner import Runner


def _case(op: str, name: str, build=None):
    """A conformance case of `op` (its comparators), or one with inputs built for the operator path."""
    base = next(c for c, _ in cases.select([op], "smoke"))
    if build is None:
        return next(c for c, _ in cases.select([op], "smoke", name))
    return dataclasses.replace(base, id=f"smoke/{name}", build=build)


def _indexer_operator_path(g, dt):
    # D_I = 128, bf16, block size 16: the npu_lightning_indexer route; more keys than topk
    return indexer_inputs(g, dt, [2, 1, 2], [150, 90, 120], h_i=4, d_i=128, block_size=16) | {"topk": 24}


def _attention_operator_path(g, dt):
    # GLM-5 latent (576 = 512 + 64, d_v 512) with 6 heads: padded to 8 for the operator
    return attn_inputs(g, dt, [2, 1], [70, 40], 24, h=6, d_qk=576, d_v=512, sm_scale=0.0625)


def _attention_mixed_invalid(g, dt):
    a = _attention_operator_path(g, dt)
    a["indices"][:, ::3] = -1  # -1 between valid entries
    a["indices"][:, 1] = 10_000  # out of range: invalid too
    return a


def _attention_decode_paged_no_lse(g, dt):
    # decode + MTP on a shuffled paged cache, more keys than topk: the selected-rows route
    a = attn_inputs(g, dt, [1, 2], [2304, 2100], 64, h=6, d_qk=576, d_v=512, block_size=16, sm_scale=0.0625)
    return a | {"return_lse": False}


BREAKS = {
    "swap cumulative and per-request key lengths": (
        "indexer_topk",
        _indexer_operator_path,
        "key_lengths_pa",
        lambda lay: ad.cumulative(lay.seqlens_k),
    ),
    "per-request query lengths for TND": (
        "indexer_topk",
        _indexer_operator_path,
        "query_lengths_tnd",
        lambda lay: lay.cu_seqlens_q[1:] - lay.cu_seqlens_q[:-1],
    ),
    "drop the head padding": (
        "sparse_mla_attention",
        _attention_operator_path,
        "pad_heads",
        lambda t, heads: t.contiguous(),
    ),
    "keep invalid indices in place": (
        "sparse_mla_attention",
        _attention_mixed_invalid,
        "valid_first",
        lambda idx, s: idx.to(torch.int32),
    ),
    "read selected positions as physical rows": (
        "sparse_mla_attention",
        _attention_decode_paged_no_lse,
        "selected_rows",
        lambda lay, cache, idx, t_req: idx.to(torch.int64).clamp(min=0),
    ),
    "pack nibbles the other way": (
        "w4a8_matmul",
        "smoke/m3_k64_n6_per_channel",
        "pack_int4_along_n",
        lambda w: _ORIG_PACK(w.reshape(*w.shape[:-1], w.shape[-1] // 8, 8).flip(-1).reshape(w.shape)),
    ),
}
_ORIG_PACK = ad.pack_int4_along_n


@pytest.mark.parametrize("what", list(BREAKS))
def test_broken_conversion_fails_conformance(backend, monkeypatch, what):
    op, build, name, broken = BREAKS[what]
    case = _case(op, build) if isinstance(build, str) else _case(op, what.replace(" ", "_"), build)
    intact = Runner(backend).run_case(case, "bfloat16")
    assert intact.status == PASS, intact.message
    monkeypatch.setattr(ad, name, broken)
    res = Runner(backend).run_case(case, "bfloat16")
    assert res.status != PASS, f"{what}: conformance still passes"
