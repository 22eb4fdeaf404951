"""Chunked linear + cross-entropy (SPEC 2.9): a hand case, torch.nn.functional.cross_entropy on the
full logits (values and gradients of h and weight), ignore_index, chunking forced by a small chunk.

Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.linear_cross_entropy import linear_cross_entropy_naive

# the package re-exports the function under the module's name
lce_mod = importlib.import_module("backends.reference.linear_cross_entropy")
# through the front door: the op's declared backward (the module's function returns (loss, lse))
linear_cross_entropy = backends.get("reference").linear_cross_entropy


def full_logits_ce(h, weight, targets, ignore_index=-100):
    """Oracle: F.cross_entropy on the whole [N, V] logits in fp64, with its autograd gradients."""
    hd = h.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(hd @ wd.T, targets.long(), ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), hd.grad, wd.grad


def run(h, weight, targets, ignore_index=-100, fn=linear_cross_entropy):
    hr, wr = h.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(hr, wr, targets, ignore_index)
    loss.backward()
    return loss.detach(), hr.grad, wr.grad


def test_hand_case():
    h = torch.tensor([[1.0]])
    w = torch.tensor([[0.0], [math.log(3.0)]])  # logits (0, ln 3): log-sum-exp = ln 4
    loss, gh, gw = run(h, w, torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(4.0), rel=1e-6)
    # d/dlogits = softmax - onehot = (1/4 - 1, 3/4); dh = sum_v g_v w_v; dw_v = g_v h
    assert gh.item() == pytest.approx(0.75 * math.log(3.0), rel=1e-6)
    assert gw.flatten().tolist() == pytest.approx([-0.75, 0.75], rel=1e-6)
    loss, _, _ = run(h, w, torch.tensor([1]))
    assert loss.item() == pytest.approx(math.log(4.0 / 3.0), rel=1e-5)


@pytest.fixture(params=[None, 3, 1], ids=["default-chunk", "3-rows", "1-row"])
def chunk_rows(request, monkeypatch):
    """Force the sequence chunking: at most `rows` rows of logits at a time."""
    if request.param is not None:
        monkeypatch.setattr(lce_mod, "_CHUNK_ELEMS", request.param * 50)  # V = 50 below
    return request.param


@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_matches_cross_entropy_on_full_logits(chunk_rows, ignore_index):
    gen = torch.Generator().manual_seed(0)
    n, d, v = 19, 16, 50
    h, w = torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen) * 0.3
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::4] = ignore_index
    got = run(h, w, targets, ignore_index)
    want = full_logits_ce(h, w, targets, ignore_index)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-6)
    naive = run(h, w, targets, ignore_index, fn=linear_cross_entropy_naive)
    for a, b in zip(got, naive, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_fp32(chunk_rows, dtype):
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(10, 8, generator=gen).to(dtype), (torch.randn(50, 8, generator=gen) * 0.3).to(dtype)
    targets = torch.randint(0, 50, (10,), generator=gen, dtype=torch.int32)
    loss = backends.get("reference").linear_cross_entropy(h.requires_grad_(), w.requires_grad_(), targets)
    loss.backward()
    gh, gw = h.grad, w.grad
    assert loss.dtype == torch.float32 and gh.dtype == dtype and gw.dtype == dtype
    want = full_logits_ce(h, w, targets)  # the same rounded inputs, in fp64
    torch.testing.assert_close(loss.double(), want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh.double(), want[1].to(dtype).double(), rtol=1.6e-2, atol=1e-4)
    torch.testing.assert_close(gw.double(), want[2].to(dtype).double(), rtol=1.6e-2, atol=1e-4)


@pytest.mark.parametrize("n", [0, 5])
def test_no_counted_target_is_nan_with_zero_gradients(n):
    h, w = torch.randn(n, 4), torch.randn(6, 4)
    loss, gh, gw = run(h, w, torch.full((n,), -100))
    assert math.isnan(loss.item())
    assert torch.equal(gh, torch.zeros(n, 4)) and torch.equal(gw, torch.zeros(6, 4))
    assert math.isnan(F.cross_entropy(h @ w.T, torch.full((n,), -100)).item())  # torch agrees on the value


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 12), st.integers(1, 9), st.integers(1, 5), st.integers(0, 2**16))
def test_fuzz_chunk_sizes_agree_with_full_logits(n, v, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, 3, generator=gen), torch.randn(v, 3, generator=gen)
    targets = torch.randint(-1, v, (n,), generator=gen)  # -1 as ignore_index
    old = lce_mod._CHUNK_ELEMS
    lce_mod._CHUNK_ELEMS = rows * v
    try:
        got = run(h, w, targets, -1)
    finally:
        lce_mod._CHUNK_ELEMS = old
    if not (targets != -1).any():
        assert math.isnan(got[0].item())
        return
    for a, b in zip(got, full_logits_ce(h, w, targets, -1), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-6)
