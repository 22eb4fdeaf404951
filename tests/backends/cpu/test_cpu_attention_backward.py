"""The cpu backend's explicit sparse-attention backward (`OpImpl.backward`, from the forward's saved out and
lse): the reference's gradients, with no recomputed forward, on ragged and paged caches with -1 padding,
NaN in unread cache rows, an empty request, more keys than topk, and with and without an lse gradient."""

from __future__ import annotations

import pytest
import torch

from backends.cpu import sparse_mla_attention as cpu_attn
from tests.backends.reference._cases import pack


def _inputs(block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [3, 0, 2, 1], [2600, 40, 2100, 7]  # more keys than topk; an empty request; few keys
    keys = [torch.randn(s, 72, generator=g) for s in k_lens]
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=seed, d=72)  # filler rows are NaN
    t, topk = sum(q_lens), 64
    idx = torch.full((t, topk), -1, dtype=torch.int32)
    row = 0
    for q_n, s in zip(q_lens, k_lens, strict=True):
        for i in range(q_n):
            vis = s - q_n + i + 1
            pick = torch.randperm(vis, generator=g)[: topk - 5]  # -1 padding at the end of every row
            idx[row, : pick.numel()] = pick.to(torch.int32)
            row += 1
    q = torch.randn(t, 4, 72, generator=g)
    return q, cache, idx, layout


def _grads(be, q, cache, idx, layout, d_out, d_lse, return_lse):
    q, cache = q.clone().requires_grad_(), cache.clone().requires_grad_()
    out, lse = be.sparse_mla_attention(q, cache, idx, layout, 0.1, 64, return_lse=return_lse)
    loss = (out * d_out).sum()
    if return_lse:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * d_lse).sum()
    loss.backward()
    return q.grad, torch.nan_to_num(cache.grad, nan=0.0)


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("return_lse", [False, True])
def test_explicit_backward_matches_reference_without_recompute(cpu, ref, monkeypatch, block_size, return_lse):
    q, cache, idx, layout = _inputs(block_size)
    g = torch.Generator().manual_seed(1)
    d_out, d_lse = torch.randn(6, 4, 64, generator=g), torch.randn(6, 4, generator=g)
    want = _grads(ref, q, cache, idx, layout, d_out, d_lse, return_lse)
    blocks = []
    real = cpu_attn._Workspace.block
    monkeypatch.setattr(cpu_attn._Workspace, "block", lambda *a: blocks.append(1) or real(*a))
    with torch.no_grad():
        cpu.sparse_mla_attention(q, cache, idx, layout, 0.1, 64)
    per_forward, blocks[:] = len(blocks), []
    got = _grads(cpu, q, cache, idx, layout, d_out, d_lse, return_lse)
    assert len(blocks) == per_forward  # the forward ran once; the backward read its out and lse
    for g_, w in zip(got, want, strict=True):
        assert torch.isfinite(g_).all()
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)
