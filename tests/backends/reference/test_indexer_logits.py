"""Indexer logits (SPEC 2.1): a hand case, an independent fp64 formulation, layouts, gradients.

Gradients: the reference computes in fp32 whatever the input, so torch.autograd.gradcheck on it in
fp64 would compare an fp32 forward against fp64 finite differences and fail on rounding, not on a
bug. Instead the independent fp64 formulation below is itself gradchecked, and the reference's
autograd gradients are compared with its gradients at fp32 tolerance.

Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import backends
from backends.reference.indexer_logits import indexer_logits
from tests.backends.reference._cases import batches, pack, request_of_token, visible_counts

INF = float("inf")


def dense_logits(q, keys, weights, q_lens, k_lens) -> torch.Tensor:
    """Independent fp64 formulation: one query at a time, relu(K q_h) weighted over heads, causal mask."""
    vis, req = visible_counts(q_lens, k_lens), request_of_token(q_lens)
    width = max(k_lens, default=0)
    rows = []
    for t in range(q.shape[0]):
        k = keys[req[t]].double()  # [S_b, D_I]
        s = (torch.relu(q[t].double() @ k.T) * weights[t].double()[:, None]).sum(0)  # [S_b]
        row = torch.full((width,), -INF, dtype=torch.float64)
        row[: vis[t]] = s[: vis[t]]
        rows.append(row)
    return torch.stack(rows) if rows else torch.empty(0, width, dtype=torch.float64)


def make(q_lens, k_lens, h_i=3, d_i=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, h_i, d_i, generator=gen).to(dtype)
    keys = [torch.randn(s, d_i, generator=gen).to(dtype) for s in k_lens]
    w = torch.randn(t, h_i, generator=gen)
    return q, keys, w


def _with_w(cache_layout, w):
    return cache_layout[0], w, cache_layout[1]


def test_hand_case_relu_before_negative_weights():
    # one request, T=2 queries, S=3 keys: query 0 sees keys 0..1, query 1 sees 0..2
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, -1.0]]])
    keys = torch.tensor([[1.0, 2.0], [-1.0, 3.0], [2.0, -2.0]])
    w = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    for bs in (None, 2):
        cache, layout = pack([keys], [2], block_size=bs)
        got = indexer_logits(q, cache, w, layout)
        # t=0: dots h0 (1,-1), h1 (2,3) -> 1*1 + 2*2 = 5, 0 + 2*3 = 6; t=1: dots h0 (3,2,0), h1 (-1,-4,4)
        assert got.tolist() == [[5.0, 6.0, -INF], [1.5, 1.0, -4.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [None, 1, 5, 16])
def test_matches_dense_fp64(dtype, block_size):
    q_lens, k_lens = [3, 0, 7, 4, 1], [9, 5, 7, 0, 33]  # chunked prefill, empty, T==S, T>S, decode
    q, keys, w = make(q_lens, k_lens, dtype=dtype)
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=3)
    got = indexer_logits(q, cache, w, layout)
    want = dense_logits(q, keys, w, q_lens, k_lens)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # NaN filler rows never leak in
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_paged_equals_ragged_bitwise_and_batch_slicing():
    q_lens, k_lens = [4, 2, 6], [50, 2, 37]
    q, keys, w = make(q_lens, k_lens, h_i=4, d_i=16, seed=1)
    ragged = indexer_logits(q, *_with_w(pack(keys, q_lens, block_size=None), w))
    paged = indexer_logits(q, *_with_w(pack(keys, q_lens, block_size=7, seed=9), w))
    assert torch.equal(ragged, paged)
    q0 = 0
    for b, (t_b, s_b) in enumerate(zip(q_lens, k_lens, strict=True)):
        cache_b, layout_b = pack([keys[b]], [t_b], block_size=3, seed=5)
        alone = indexer_logits(q[q0 : q0 + t_b], cache_b, w[q0 : q0 + t_b], layout_b)
        assert torch.equal(alone, ragged[q0 : q0 + t_b, : alone.shape[1]])
        assert torch.isinf(ragged[q0 : q0 + t_b, s_b:]).all()
        q0 += t_b


def test_backend_method_and_empty_batch():
    q, keys, w = make([2], [5])
    be = backends.get("reference")
    cache, layout = pack(keys, [2])
    assert torch.equal(be.indexer_logits(q, cache, w, layout), indexer_logits(q, cache, w, layout))
    empty = backends.SeqLayout.from_lengths([], [])
    out = be.indexer_logits(torch.zeros(0, 3, 8), torch.zeros(0, 8), torch.zeros(0, 3), empty)
    assert out.shape == (0, 0)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_fuzz_layouts_match_dense(case):
    q_lens, k_lens = case["q_lens"], case["k_lens"]
    q, keys, w = make(q_lens, k_lens, h_i=2, d_i=4, seed=case["seed"])
    cache, layout = pack(keys, q_lens, block_size=case["block_size"], seed=case["seed"], d=4)
    got = backends.get("reference").indexer_logits(q, cache, w, layout)
    want = dense_logits(q, keys, w, q_lens, k_lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _dense_finite(q, keys_flat, w, q_lens, k_lens):
    """dense_logits of a flat key tensor with -inf (non-causal) set to 0, so gradcheck sees finite outputs."""
    out = dense_logits(q, list(torch.split(keys_flat, k_lens)), w, q_lens, k_lens)
    return out.masked_fill(torch.isinf(out), 0.0)


def test_gradients_match_independent_fp64_formulation():
    q_lens, k_lens = [3, 2], [6, 9]
    q, keys, w = make(q_lens, k_lens, h_i=2, d_i=4, seed=7)
    keys_flat = torch.cat(keys)
    # the oracle's own gradients are right: finite differences in fp64
    args = tuple(t.double().requires_grad_() for t in (q, keys_flat, w))
    assert torch.autograd.gradcheck(lambda a, b, c: _dense_finite(a, b, c, q_lens, k_lens), args)
    # the reference (ragged, compact: cache rows == logical keys) against it
    layout = backends.SeqLayout.from_lengths(q_lens, k_lens)
    qr, kr, wr = (t.detach().clone().requires_grad_() for t in (q, keys_flat, w))
    got = indexer_logits(qr, kr, wr, layout)
    mask = torch.isinf(got)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(0)).masked_fill(mask, 0.0)
    got.masked_fill(mask, 0.0).mul(g).sum().backward()
    qd, kd, wd = (t.detach().double().requires_grad_() for t in (q, keys_flat, w))
    _dense_finite(qd, kd, wd, q_lens, k_lens).mul(g.double()).sum().backward()
    for a, b in ((qr, qd), (kr, kd), (wr, wd)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)
