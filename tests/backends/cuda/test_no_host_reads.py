"""The cuda indexer ops read nothing back to the host (so a CUDA graph can capture a decode step): the query
tiling is computed on the device, and the ops run on a trusted layout (host max_seqlen_k) while
`SeqLayout.host()` refuses to be called, matching the reference."""

from __future__ import annotations

import pytest
import torch

import backends
from backends import SeqLayout
from backends.reference.fp8_indexer_logits import quantize_indexer_inputs
from kernels_cuda._indexer_score import query_tiles
from tests.backends.cuda.test_indexer_topk import make


def _host_tiles(q_lens, block_t):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    t = cu[-1]
    real = [(b, t0) for b in range(len(q_lens)) for t0 in range(cu[b], cu[b + 1], block_t)]
    pad = -(-t // block_t) + len(q_lens) - len(real)
    return real + [(0, t)] * pad


@pytest.mark.parametrize("q_lens", [[5], [0, 3, 0, 17, 1], [4, 4, 4], [1] * 9, [0, 0, 2]])
@pytest.mark.parametrize("block_t", [1, 4, 16])
def test_device_tiling_is_the_host_tiling(q_lens, block_t):
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    got = query_tiles(cu, sum(q_lens), block_t)
    assert got.dtype == torch.int32
    assert got.tolist() == [list(x) for x in _host_tiles(q_lens, block_t)]


def _no_host(monkeypatch):
    def refuse(self):
        raise AssertionError("SeqLayout.host() called on the hot path")

    monkeypatch.setattr(SeqLayout, "host", refuse)


def _trusted(layout: SeqLayout, device) -> SeqLayout:
    out = layout.to(device)
    out.max_seqlen_k, out.trusted = int(layout.seqlens_k.max()), True
    return out


@pytest.mark.parametrize("block_size", [None, 13])
def test_indexer_ops_make_no_host_reads(cuda, device, monkeypatch, block_size):
    q, cache, w, layout = make([4, 1, 3, 0], [260, 180, 40, 7], block_size=block_size)
    ref = backends.get("reference")
    want_logits = ref.indexer_logits(q, cache, w, layout)
    want_topk = ref.indexer_topk(q, cache, w, layout, 32)
    trusted = _trusted(layout, device)
    _no_host(monkeypatch)
    dev = [t.to(device) for t in (q, cache, w)]
    torch.testing.assert_close(cuda.indexer_logits(*dev, trusted).cpu(), want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(cuda.indexer_topk(*dev, trusted, 32).cpu(), want_topk)


def test_fp8_indexer_ops_make_no_host_reads(cuda, device, monkeypatch):
    g = torch.Generator().manual_seed(4)
    q_lens, k_lens = [1, 3, 0, 2], [300, 150, 9, 2]
    q, k = torch.randn(6, 32, 128, generator=g), torch.randn(sum(k_lens), 128, generator=g)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, torch.randn(6, 32, generator=g) / 64)
    layout = SeqLayout.from_lengths(q_lens, k_lens)
    ref = backends.get("reference")
    want_logits = ref.fp8_indexer_logits(q8, k8, ks, w8, layout)
    want_topk = ref.fp8_indexer_topk(q8, k8, ks, w8, layout, 64)
    trusted = _trusted(layout, device)
    _no_host(monkeypatch)
    dev = [t.to(device) for t in (q8, k8, ks, w8)]
    got = cuda.fp8_indexer_logits(*dev, trusted).cpu()
    torch.testing.assert_close(got, want_logits, rtol=2e-5, atol=1e-5)
    assert torch.equal(cuda.fp8_indexer_topk(*dev, trusted, 64).cpu(), want_topk)
