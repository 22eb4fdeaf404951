"""cuda linear_cross_entropy: forward and backward in sequence chunks (forced small here), ignore_index,
NaN with no counted target, gradients for h and weight against the reference.

Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
"""

from __future__ import annotations

import pytest
import torch

import backends
from backends.cuda import linear_cross_entropy as cuda_lce
from tests.backends.cuda.conftest import skip_bf16_interpreted

reference = backends.get("reference").linear_cross_entropy

#: loss and gradient tolerances: fp32 sums in another order than the reference (SPEC 4 defaults, fp32 loosened
#: to the conformance suite's reduction tolerance)
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def _inputs(n, d, v, dtype, seed=0, ignored=(1, 3)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[[i for i in ignored if i < n]] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t, device, chunk_rows=None, **kw):
    """fn's loss and gradients; chunk_rows: the cuda backend's rows per chunk for this call."""
    h = h.to(device).requires_grad_()
    w = w.to(device).requires_grad_()
    was, cuda_lce.CHUNK_ROWS = cuda_lce.CHUNK_ROWS, chunk_rows
    try:
        loss = fn(h, w, t.to(device), **kw)
        loss.backward()
    finally:
        cuda_lce.CHUNK_ROWS = was
    return loss.detach().cpu(), h.grad.cpu(), w.grad.cpu()


@pytest.fixture
def chunked(cuda):
    return cuda.linear_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n,d,v,chunk_rows", [(10, 16, 50, None), (37, 24, 300, 8), (5, 8, 7, 2), (9, 32, 4100, 4)]
)
def test_chunked_loss_and_grads_match_reference(chunked, device, dtype, n, d, v, chunk_rows):
    skip_bf16_interpreted(dtype)
    h, w, t = _inputs(n, d, v, dtype, seed=n + v)
    got = _loss_and_grads(chunked, h, w, t, device, chunk_rows=chunk_rows)
    want = _loss_and_grads(reference, h, w, t, "cpu")
    rtol, atol = TOL[dtype]
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a, r, rtol=rtol, atol=atol)


def test_chunking_does_not_change_the_result_much(chunked, device):
    h, w, t = _inputs(24, 16, 70, torch.float32, seed=1)
    whole = _loss_and_grads(chunked, h, w, t, device)
    for rows in (1, 5, 23):
        for a, r in zip(_loss_and_grads(chunked, h, w, t, device, chunk_rows=rows), whole, strict=True):
            torch.testing.assert_close(a, r, rtol=2e-5, atol=1e-6)


def test_backend_call_counts_launches_and_is_differentiable(cuda, device, launches):
    h, w, t = _inputs(6, 8, 20, torch.float32)
    h, w = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    loss = cuda.linear_cross_entropy(h, w, t.to(device))
    assert launches()["linear_cross_entropy"] == 2  # logits GEMM + logsumexp
    loss.backward()
    # the declared backward alone: each chunk's logits again and the gradient in place (+2); the forward
    # does not run again (it did through the recompute backward: 6 launches)
    assert launches()["linear_cross_entropy"] == 4
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_no_counted_target_gives_nan_and_zero_grads(cuda, device):
    h, w, _ = _inputs(4, 8, 6, torch.float32)
    t = torch.full((4,), 7)
    loss, gh, gw = _loss_and_grads(cuda.linear_cross_entropy, h, w, t, device, ignore_index=7)
    assert loss.isnan() and not gh.any() and not gw.any()
    empty = cuda.linear_cross_entropy(h[:0].to(device), w.to(device), t[:0].to(device))
    assert empty.isnan()


def test_int32_targets_and_custom_ignore_index(chunked, device):
    h, w, t = _inputs(8, 8, 10, torch.float32, ignored=())
    t[2] = 3
    got = _loss_and_grads(chunked, h, w, t.int(), device, ignore_index=3)
    want = _loss_and_grads(reference, h, w, t, "cpu", ignore_index=3)
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=1e-5)


def test_bad_targets_name_the_argument(cuda, device):
    h, w, t = _inputs(4, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="^targets: expected values in"), cuda.validating():  # a value check
        cuda.linear_cross_entropy(h.to(device), w.to(device), (t + 10).to(device))
