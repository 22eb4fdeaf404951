"""linear_cross_entropy: chunked triton-ascend kernels, forward and gradients against the reference."""

from __future__ import annotations

import torch

from backends.ascend import linear_cross_entropy as mod


def test_forward_and_gradients_match_reference(backend, reference, monkeypatch):
    monkeypatch.setattr(mod, "CHUNK_ELEMS", 7 * 40)  # several chunks of 7 rows
    g = torch.Generator().manual_seed(0)
    h = torch.randn(19, 24, generator=g)
    w = torch.randn(40, 24, generator=g)
    t = torch.randint(0, 40, (19,), generator=g)
    t[3] = t[11] = -100
    grads = []
    for be in (backend, reference):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = be.linear_cross_entropy(hh, ww, t)
        loss.backward()
        grads.append((loss.detach(), hh.grad, ww.grad))
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=1e-5)


def test_no_counted_target_gives_nan(backend):
    assert torch.isnan(
        backend.linear_cross_entropy(torch.randn(3, 8), torch.randn(5, 8), torch.full((3,), -100))
    )
