"""cuda linear_cross_entropy_shard: the shard's max, sum of exponentials and target logit (targets in the
shard, in others, ignored) and the gradients of h and weight through them, against the reference.

Semantics: backends/reference/linear_cross_entropy_shard.py (SPEC 2.9.1)
"""

from __future__ import annotations

import pytest
import torch

import backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(10, 32, generator=g).to(dtype)
    w = (torch.randn(24, 32, generator=g) * 0.3).to(dtype)
    t = torch.tensor([24, 47, 23, 48, -100, 0, 30, 25, 71, 36])  # this shard: rows [24, 48)
    ws = torch.rand(2, 10, generator=g)
    res = {}
    for name in ("cuda", "reference"):
        backend = backends.get(name)
        before = backend.calls["linear_cross_entropy_shard"]
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        m, s, tl = backend.linear_cross_entropy_shard(hr, wr, t, 24)
        ((s * ws[0]).sum() + (tl * ws[1]).sum()).backward()
        assert backend.calls["linear_cross_entropy_shard"] == before + 1
        res[name] = (m.detach(), s.detach(), tl.detach(), hr.grad.float(), wr.grad.float())
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    for a, b in zip(res["cuda"], res["reference"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
    assert not res["cuda"][2][[2, 3, 4, 5, 8]].any()
