"""cuda grouped_matmul backward (float variant): dx through the forward kernel on w's transposed view,
dw by one launch over (expert, N-tile, K-tile) that reads the offsets on the device; against autograd of
a float64 per-expert loop, empty experts and experts larger than a tile included.

Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.cuda.conftest import skip_bf16_interpreted

SIZES = [[3, 0, 40, 1], [0, 0, 5], [0, 4, 0], [0, 0]]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _offsets(sizes):
    return torch.tensor([0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def _oracle(x, w, sizes, dy):
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    offs = _offsets(sizes).tolist()
    out = torch.cat([xd[offs[e] : offs[e + 1]] @ wd[e].T for e in range(len(sizes))])
    torch.autograd.backward(out, dy.double())
    return xd.grad, wd.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES)
def test_gradients_match_a_float64_per_expert_loop(cuda, device, launches, dtype, sizes):
    skip_bf16_interpreted(dtype)
    g = torch.Generator().manual_seed(len(sizes))
    m, e, n, k = sum(sizes), len(sizes), 70, 80  # N, K past one 64-wide tile
    x, w = (torch.randn(m, k, generator=g) * k**-0.5).to(dtype), torch.randn(e, n, k, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    xs, ws = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    cuda.grouped_matmul(xs, ws, _offsets(sizes).to(device)).backward(dy.to(device))
    want_dx, want_dw = _oracle(x, w, sizes, dy)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(xs.grad.cpu().double(), want_dx, rtol=rtol, atol=atol)
    torch.testing.assert_close(ws.grad.cpu().double(), want_dw, rtol=rtol, atol=atol)
    for i, s in enumerate(sizes):
        if s == 0:
            assert not ws.grad[i].any()
    assert launches()["grouped_matmul_dw"] == 1


def test_dx_reads_w_as_it_is_and_a_strided_gradient(cuda, device):
    sizes = [2, 3]
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    xs, ws = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    out = cuda.grouped_matmul(xs, ws, _offsets(sizes).to(device))
    out.sum().backward()  # the gradient is an expanded (stride 0) tensor
    want_dx, want_dw = _oracle(x, w, sizes, torch.ones(5, 8))
    torch.testing.assert_close(xs.grad.cpu().double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws.grad.cpu().double(), want_dw, rtol=1e-5, atol=1e-5)
    assert cuda.relayouts["grouped_matmul"] == 0
