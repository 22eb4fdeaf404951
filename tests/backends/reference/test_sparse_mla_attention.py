"""Sparse MLA attention (SPEC 2.4): paper-sized hand cases, equality with dense causal softmax
attention when every causal key is selected, metamorphic properties, NaN in unread rows, gradients.

Gradients: the reference runs in fp32 whatever the input dtype, so gradcheck on it in fp64 would
measure fp32 rounding. The independent dense formulation is gradchecked in fp64 instead, and the
reference's autograd gradients are compared with the dense formulation's at fp32 tolerance.

Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.sparse_mla_attention import sparse_mla_attention
from tests.backends.reference._cases import batches, pack, request_of_token, visible_counts

INF = float("inf")


def dense_causal(q, keys, q_lens, k_lens, sm_scale, d_v):
    """Independent formulation: per request, torch.softmax over a right-down causal mask, fp64."""
    outs, lses, q0 = [], [], 0
    for t_b, s_b, k in zip(q_lens, k_lens, keys, strict=True):
        qb, kb = q[q0 : q0 + t_b].double(), k.double()  # [T_b, H, d_qk], [S_b, d_qk]
        scores = torch.einsum("thd,sd->hts", qb, kb) * sm_scale
        mask = torch.ones(t_b, s_b, dtype=torch.bool).tril(diagonal=s_b - t_b)
        scores = scores.masked_fill(~mask, -INF)
        lse = torch.logsumexp(scores, dim=-1)  # [H, T_b]
        empty = ~mask.any(-1)
        prob = torch.softmax(scores.masked_fill(empty[None, :, None], 0.0), dim=-1).masked_fill(
            empty[None, :, None], 0
        )
        outs.append(torch.einsum("hts,sd->thd", prob, kb[:, :d_v]))
        lses.append(lse.T)
        q0 += t_b
    return torch.cat(outs), torch.cat(lses)


def all_causal_indices(q_lens, k_lens, width, seed=0) -> torch.Tensor:
    """Every causal key of every query, shuffled within the row, -1 padded to `width`."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for vis in visible_counts(q_lens, k_lens):
        row = torch.randperm(vis, generator=gen).tolist()
        rows.append(row + [-1] * (width - vis))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)


def make(q_lens, k_lens, h=2, d_qk=12, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), h, d_qk, generator=gen).to(dtype)
    keys = [torch.randn(s, d_qk, generator=gen).to(dtype) for s in k_lens]
    return q, keys


def test_two_keys_on_paper():
    # sm_scale 0.5, q = (0, 2): p = (0, ln 3) -> probs 1/4, 3/4; lse = ln 4; out = 10/4 + 3*20/4
    q = torch.tensor([[[0.0, 2.0]]])
    keys = torch.tensor([[10.0, 0.0], [20.0, math.log(3.0)]])
    for bs in (None, 1):
        cache, layout = pack([keys], [1], block_size=bs)
        out, lse = sparse_mla_attention(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), layout, 0.5, 1)
        torch.testing.assert_close(out, torch.tensor([[[17.5]]]))
        torch.testing.assert_close(lse, torch.tensor([[math.log(4.0)]]))
        # a valid index listed twice counts twice: weights 1:3:3; -1 and out-of-range are skipped
        idx = torch.tensor([[0, -1, 1, 5, 1, -7]], dtype=torch.int32)
        out, lse = sparse_mla_attention(q, cache, idx, layout, 0.5, 1)
        torch.testing.assert_close(out, torch.tensor([[[130.0 / 7.0]]]))
        torch.testing.assert_close(lse, torch.tensor([[math.log(7.0)]]))


def test_all_minus_one_gives_zero_and_minus_inf():
    q, keys = make([3, 2], [5, 0])
    cache, layout = pack(keys, [3, 2], d=12)
    idx = torch.full((5, 4), -1, dtype=torch.int32)
    idx[3:, 0] = 0  # request 1 has no keys: position 0 is out of range there
    out, lse = sparse_mla_attention(q, cache, idx, layout, 0.1, 8)
    assert torch.equal(out, torch.zeros(5, 2, 8)) and torch.equal(lse, torch.full((5, 2), -INF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [None, 3, 64])
def test_every_causal_key_equals_dense_causal_attention(dtype, block_size):
    q_lens, k_lens = [5, 1, 70, 3], [90, 77, 70, 2]  # chunked prefill, decode, training T==S, T>S
    q, keys = make(q_lens, k_lens, dtype=dtype, seed=block_size or 0)
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=1)
    idx = all_causal_indices(q_lens, k_lens, 96)
    out, lse = sparse_mla_attention(q, cache, idx, layout, 0.0625, 8)
    want_out, want_lse = dense_causal(q, keys, q_lens, k_lens, 0.0625, 8)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out.double(), want_out.to(dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_metamorphic_permutation_padding_out_of_range_batch_layout():
    q_lens, k_lens, k = [4, 2, 3], [120, 40, 3], 64
    q, keys = make(q_lens, k_lens, h=4, d_qk=16, seed=3)
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack(
        [
            torch.randperm(s, generator=gen)[:k]
            if s >= k
            else torch.cat([torch.randperm(s, generator=gen), torch.full((k - s,), -1)])
            for s in (k_lens[b] for b in request_of_token(q_lens))
        ]
    ).to(torch.int32)
    cache, layout = pack(keys, q_lens, block_size=None)
    base = sparse_mla_attention(q, cache, idx, layout, 0.2, 10)

    def close(other):
        torch.testing.assert_close(other[0], base[0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(other[1], base[1], rtol=1e-6, atol=1e-6)

    close(sparse_mla_attention(q, cache, idx[:, torch.randperm(k, generator=gen)], layout, 0.2, 10))
    junk = torch.tensor([-1, -5, 10**6, 120, -(2**31)], dtype=torch.int32).expand(idx.shape[0], -1)
    close(sparse_mla_attention(q, cache, torch.cat([idx, junk], dim=1), layout, 0.2, 10))
    # the same keys paged: bitwise (same gathered keys, same arithmetic)
    paged = sparse_mla_attention(q, *_args(pack(keys, q_lens, block_size=7, seed=4), idx), 0.2, 10)
    assert torch.equal(paged[0], base[0]) and torch.equal(paged[1], base[1])
    # a request alone == inside the batch, bitwise (the reference claims batch invariance)
    q0 = 0
    for b, t_b in enumerate(q_lens):
        sl = slice(q0, q0 + t_b)
        alone = sparse_mla_attention(q[sl], *_args(pack([keys[b]], [t_b], block_size=5), idx[sl]), 0.2, 10)
        assert torch.equal(alone[0], base[0][sl]) and torch.equal(alone[1], base[1][sl])
        q0 += t_b


def _args(cache_layout, idx):
    return cache_layout[0], idx, cache_layout[1]


def test_nan_in_rows_no_index_names_is_never_read():
    q_lens, k_lens = [3, 2], [60, 30]
    q, keys = make(q_lens, k_lens, seed=6)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 30, (5, 8), generator=gen, dtype=torch.int32)
    named = [set(idx[t].tolist()) for t in range(5)]
    poisoned = [k.clone() for k in keys]
    for b, rows in ((0, set().union(*named[:3])), (1, set().union(*named[3:]))):
        for j in range(k_lens[b]):
            if j not in rows:
                poisoned[b][j] = float("nan")
    for bs in (None, 4):
        clean = sparse_mla_attention(q, *_args(pack(keys, q_lens, block_size=bs), idx), 0.3, 6)
        dirty = sparse_mla_attention(q, *_args(pack(poisoned, q_lens, block_size=bs), idx), 0.3, 6)
        assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_gradients_match_dense_formulation():
    q_lens, k_lens = [3, 4], [5, 4]
    q, keys = make(q_lens, k_lens, h=2, d_qk=6, seed=9)
    sm, d_v = 0.4, 4

    def dense(qd, kflat):
        parts = list(torch.split(kflat, k_lens))
        out, lse = dense_causal(qd, parts, q_lens, k_lens, sm, d_v)
        return out, lse

    kflat = torch.cat(keys)
    assert torch.autograd.gradcheck(dense, (q.double().requires_grad_(), kflat.double().requires_grad_()))
    layout = backends.SeqLayout.from_lengths(q_lens, k_lens)
    idx = all_causal_indices(q_lens, k_lens, 6, seed=2)
    gen = torch.Generator().manual_seed(3)
    g_out, g_lse = torch.randn(7, 2, d_v, generator=gen), torch.randn(7, 2, generator=gen)
    qr, kr = q.clone().requires_grad_(), kflat.clone().requires_grad_()
    out, lse = sparse_mla_attention(qr, kr, idx, layout, sm, d_v)
    ((out * g_out).sum() + (lse * g_lse).sum()).backward()
    qd, kd = q.double().requires_grad_(), kflat.double().requires_grad_()
    out_d, lse_d = dense(qd, kd)
    ((out_d * g_out.double()).sum() + (lse_d * g_lse.double()).sum()).backward()
    torch.testing.assert_close(qr.grad.double(), qd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kr.grad.double(), kd.grad, rtol=1e-5, atol=1e-5)


def test_empty_rows_have_zero_gradients_not_nan():
    q, keys = make([2], [3], d_qk=4)
    layout = backends.SeqLayout.from_lengths([2], [3])
    qr, kr = q.clone().requires_grad_(), keys[0].clone().requires_grad_()
    idx = torch.tensor([[-1, -1], [0, 2]], dtype=torch.int32)
    out, lse = sparse_mla_attention(qr, kr, idx, layout, 0.5, 2)
    (out.sum() + lse[1].sum()).backward()
    assert torch.equal(qr.grad[0], torch.zeros(2, 4)) and torch.isfinite(qr.grad).all()
    assert torch.equal(kr.grad[1], torch.zeros(4)) and torch.isfinite(kr.grad).all()


@settings(max_examples=50, deadline=None)
@given(batches(max_q=5, max_k=30), st.integers(1, 40))
def test_fuzz_random_indices_match_dense_gather(case, k):
    """Random indices (valid, -1, out of range, duplicates) against a per-query gather in fp64."""
    q_lens, k_lens = case["q_lens"], case["k_lens"]
    q, keys = make(q_lens, k_lens, h=2, d_qk=5, seed=case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    idx = torch.randint(-3, max(k_lens, default=0) + 3, (sum(q_lens), k), generator=gen, dtype=torch.int32)
    cache, layout = pack(keys, q_lens, block_size=case["block_size"], seed=case["seed"], d=5)
    out, lse = backends.get("reference").sparse_mla_attention(q, cache, idx, layout, 0.3, 3)
    req = request_of_token(q_lens)
    for t in range(sum(q_lens)):
        valid = [j for j in idx[t].tolist() if 0 <= j < k_lens[req[t]]]
        if not valid:
            assert torch.equal(out[t], torch.zeros(2, 3)) and torch.equal(lse[t], torch.full((2,), -INF))
            continue
        kv = keys[req[t]][valid].double()  # [n, d_qk], duplicates kept
        p = q[t].double() @ kv.T * 0.3
        torch.testing.assert_close(lse[t].double(), torch.logsumexp(p, -1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[t].double(), torch.softmax(p, -1) @ kv[:, :3], rtol=1e-5, atol=1e-6)
