"""cuda sparse_mla_attention (SPEC 2.4): forward and backward kernels against the reference.

Specific to the kernels: the in-kernel translation of logical positions (ragged offsets, paged block
tables with odd block sizes and shuffled blocks), masked gathers that never read unreferenced rows (NaN
filler), -1 / out-of-range / duplicated indices, empty rows (out 0, lse -inf), heads that do not fill a
head block, d_qk == d_v (no rope part), and the backward incl. a gradient through lse.
Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from backends.reference.sparse_mla_attention import sparse_mla_attention as ref_attn
from tests.backends.cuda.conftest import skip_bf16_interpreted
from tests.backends.reference._cases import pack

OUT_TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=3e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=3 / 128, atol=8e-4),
}


def make(q_lens, k_lens, *, heads=3, d_qk=48, topk=40, dtype=torch.float32, block_size=None, seed=0):
    """Indices mix valid positions, -1 and out-of-range values; row 0 is empty, row 1 has duplicates."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, heads, d_qk, generator=gen).to(dtype)
    keys = [torch.randn(s, d_qk, generator=gen).to(dtype) for s in k_lens]
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=seed, d=d_qk, dtype=dtype)
    limit = [s for s, n in zip(k_lens, q_lens, strict=True) for _ in range(n)]
    idx = torch.stack([torch.randint(-1, s + 3, (topk,), generator=gen) for s in limit]).to(torch.int32)
    idx[0] = -1
    if t > 1:
        idx[1, :5] = idx[1, 5].clamp(min=0)
    return q, cache, idx, layout


def forward(cuda, device, q, cache, idx, layout, d_v, scale=0.0625):
    return cuda.sparse_mla_attention(
        q.to(device), cache.to(device), idx.to(device), layout.to(device), scale, d_v
    )


def check_forward(got, want, dtype):
    (out, lse), (r_out, r_lse) = got, want
    assert out.dtype == dtype and lse.dtype == torch.float32
    out, lse = out.cpu().float(), lse.cpu()
    assert not torch.isnan(out).any(), "a NaN filler row was read"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    torch.testing.assert_close(out, r_out.float(), **OUT_TOL[dtype])
    fin = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[fin], r_lse[fin], rtol=8 / 65536, atol=1e-5)


@pytest.mark.parametrize("block_size", [None, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_matches_reference(cuda, device, launches, dtype, block_size):
    skip_bf16_interpreted(dtype)
    q, cache, idx, layout = make([3, 1, 2], [150, 90, 33], dtype=dtype, block_size=block_size)
    check_forward(
        forward(cuda, device, q, cache, idx, layout, 32), ref_attn(q, cache, idx, layout, 0.0625, 32), dtype
    )
    assert launches()["sparse_mla_fwd"] == 1


def test_empty_rows_give_zero_and_neg_inf(cuda, device):
    q, cache, idx, layout = make([2, 2], [20, 0])
    idx[1] = 25  # all out of range for a 20-key request
    out, lse = forward(cuda, device, q, cache, idx, layout, 32)
    assert torch.equal(out.cpu()[[0, 1, 2, 3]], torch.zeros(4, 3, 32))  # request 1 has no key at all
    assert torch.isneginf(lse.cpu()).all()


@pytest.mark.parametrize("heads,d_qk,d_v", [(17, 32, 32), (2, 80, 64)])
def test_head_blocks_and_row_split(cuda, device, heads, d_qk, d_v):
    """17 heads: a partial second head block; d_qk == d_v: no rope part; 80/64: a 16-wide rope part."""
    q, cache, idx, layout = make([2, 3], [70, 120], heads=heads, d_qk=d_qk, block_size=9)
    check_forward(
        forward(cuda, device, q, cache, idx, layout, d_v),
        ref_attn(q, cache, idx, layout, 0.0625, d_v),
        torch.float32,
    )


def test_forward_is_deterministic(cuda, device):
    q, cache, idx, layout = make([3], [100], dtype=torch.float16)
    a = forward(cuda, device, q, cache, idx, layout, 32)
    b = forward(cuda, device, q, cache, idx, layout, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _grads(fn, q, cache, d_out, d_lse):
    q = q.detach().clone().requires_grad_()
    cache = cache.detach().clone().requires_grad_()
    out, lse = fn(q, cache)
    loss = (out.float() * d_out).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * d_lse).sum()
    loss.backward()
    return q.grad, cache.grad


@pytest.mark.parametrize("block_size", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_matches_reference_autograd(cuda, device, launches, dtype, block_size):
    q, cache, idx, layout = make([3, 2], [80, 50], dtype=dtype, block_size=block_size, seed=5)
    gen = torch.Generator().manual_seed(6)
    d_out = torch.randn(5, 3, 32, generator=gen)
    d_lse = torch.randn(5, 3, generator=gen)
    dev = layout.to(device)
    got = _grads(
        lambda a, c: cuda.sparse_mla_attention(a, c, idx.to(device), dev, 0.0625, 32),
        q.to(device),
        cache.to(device),
        d_out.to(device),
        d_lse.to(device),
    )
    want = _grads(
        lambda a, c: ref_attn(a.float(), c.float(), idx, layout, 0.0625, 32), q, cache, d_out, d_lse
    )
    # the backward kernel reads the forward's saved out and lse: no recomputed forward
    assert launches()["sparse_mla_bwd"] == 1 and launches()["sparse_mla_fwd"] == 1
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        g = g.cpu().float()
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w.float(), **tol)


def test_backward_without_lse_runs_the_forward_once(cuda, device, launches):
    """The model calls with return_lse=False; a gradient still needs lse, so the front door makes it (and
    returns None), and the backward reads it: one forward and one backward launch, the reference's grads."""
    q, cache, idx, layout = make([3, 2], [80, 50], dtype=torch.float32, seed=9)
    d_out = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1))
    got_q, got_c = (t.detach().to(device).clone().requires_grad_() for t in (q, cache))
    out, lse = cuda.sparse_mla_attention(
        got_q, got_c, idx.to(device), layout.to(device), 0.0625, 32, return_lse=False
    )
    assert lse is None
    (out * d_out.to(device)).sum().backward()
    assert launches() == Counter({"sparse_mla_fwd": 1, "sparse_mla_bwd": 1})
    assert cuda.calls["sparse_mla_attention.backward"] >= 1
    want_q, want_c = (t.detach().clone().requires_grad_() for t in (q, cache))
    (ref_attn(want_q, want_c, idx, layout, 0.0625, 32)[0] * d_out).sum().backward()
    torch.testing.assert_close(got_q.grad.cpu(), want_q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_c.grad.cpu(), want_c.grad, rtol=1e-5, atol=1e-5)
