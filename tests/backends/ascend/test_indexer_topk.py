"""indexer_topk through the emulated npu_lightning_indexer: conversions, the tie rule, broken adapters."""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from backends.ascend import _adapters as ad
from backends.ascend import indexer_topk as mod
from backends.ascend.emulation import OperatorRejected

TOPK = 32


def _inputs(paged: bool, heads: int = 4, seed: int = 0):
    # more keys than topk (and than the candidate count K'), several requests, shuffled blocks
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [3, 2, 1], [120, 70, 90]
    if paged:
        lay = SeqLayout.from_lengths(q_lens, k_lens, block_size=16, block_order=list(range(19))[::-1])
        cache = torch.randn(19, 16, 128, generator=g).bfloat16()
    else:
        lay = SeqLayout(
            torch.tensor([0, 3, 5, 6], dtype=torch.int32),
            torch.tensor(k_lens, dtype=torch.int32),
            cu_seqlens_k=torch.tensor([5, 130, 200, 300], dtype=torch.int32),
        )
        cache = torch.randn(300, 128, generator=g).bfloat16()
    q = torch.randn(6, heads, 128, generator=g).bfloat16()
    w = torch.randn(6, heads, generator=g)
    return q, cache, w, lay


@pytest.mark.parametrize("paged", [False, True])
def test_matches_reference(backend, reference, paged):
    q, cache, w, lay = _inputs(paged)
    assert torch.equal(
        backend.indexer_topk(q, cache, w, lay, TOPK), reference.indexer_topk(q, cache, w, lay, TOPK)
    )
    assert backend.provider.calls["npu_lightning_indexer"] == 1


def test_ties_follow_the_rule_despite_the_operator(backend, reference):
    # duplicated keys tie exactly; the emulated operator breaks ties towards the higher position
    q, cache, w, lay = _inputs(True)
    cache[3] = cache[4]
    cache[:, 1:9] = cache[:, :1]
    assert torch.equal(
        backend.indexer_topk(q, cache, w, lay, TOPK), reference.indexer_topk(q, cache, w, lay, TOPK)
    )


def test_tie_group_past_the_candidates_falls_back_to_exact_kernels(backend, reference):
    q, cache, w, lay = _inputs(True)
    # every key ties, exactly in any summation order: small integers (the interpreted kernels' dots are
    # NumPy's BLAS, which sums identical columns in different orders on some CPUs)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-3, 4, q.shape, generator=g).bfloat16()
    w = torch.randint(-3, 4, w.shape, generator=g).float()
    cache[:] = torch.randint(-3, 4, cache.shape[-1:], generator=g).bfloat16()
    out = backend.indexer_topk(q, cache, w, lay, TOPK)
    assert torch.equal(out, reference.indexer_topk(q, cache, w, lay, TOPK))
    assert any("tie fallback" in route for _, route in backend.provider.routes)


def test_operator_limits_route_to_kernels(backend, reference):
    q, cache, w, lay = _inputs(False)
    qf, cf = q[..., :64].float(), cache[:, :64].float()  # fp32, D_I = 64: not the operator's
    assert torch.equal(
        backend.indexer_topk(qf, cf, w, lay, TOPK), reference.indexer_topk(qf, cf, w, lay, TOPK)
    )
    assert backend.provider.calls["npu_lightning_indexer"] == 0


def test_heads_are_padded_for_ascend_950(make_backend, reference):
    be = make_backend("950")  # N1 in {8, 16, 24, 32, 64}
    q, cache, w, lay = _inputs(True, heads=5)
    w = w.bfloat16().float()  # 950 takes bf16 weights only
    assert torch.equal(
        be.indexer_topk(q, cache, w, lay, TOPK), reference.indexer_topk(q, cache, w, lay, TOPK)
    )


def _breaks(be, ref, inputs) -> bool:
    q, cache, w, lay = inputs
    try:
        return not torch.equal(
            be.indexer_topk(q, cache, w, lay, TOPK), ref.indexer_topk(q, cache, w, lay, TOPK)
        )
    except OperatorRejected:
        return True


def test_swapped_key_lengths_make_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(ad, "key_lengths_pa", lambda lay: ad.cumulative(lay.seqlens_k))
    assert _breaks(backend, reference, _inputs(True))


def test_per_request_query_lengths_make_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(ad, "query_lengths_tnd", lambda lay: lay.cu_seqlens_q[1:] - lay.cu_seqlens_q[:-1])
    assert _breaks(backend, reference, _inputs(False))


def test_dropped_head_padding_makes_conformance_fail(make_backend, reference, monkeypatch):
    be = make_backend("950")
    monkeypatch.setattr(ad, "pad_heads", lambda t, heads: t.contiguous())
    assert _breaks(be, reference, _inputs(True, heads=5))


def test_candidate_count_is_an_accepted_sparse_count():
    assert mod.candidate_count(2048) == 3072
    assert mod.candidate_count(32) == 48
    assert mod.candidate_count(8192) == 8192
