"""Ascend grouped_matmul backward (float variant): dx through the emulated npu_grouped_matmul reading an
unprepared w as it is (bf16/fp16), else kernels per expert; dw by a kernels_ascend GEMM per non-empty
expert; against autograd of a float64 per-expert loop, empty experts included."""

from __future__ import annotations

import pytest
import torch

OFFS = torch.tensor([0, 4, 4, 11, 13])  # an empty expert
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _oracle(x, w, dy):
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    offs = OFFS.tolist()
    out = torch.cat([xd[offs[e] : offs[e + 1]] @ wd[e].T for e in range(len(offs) - 1)])
    torch.autograd.backward(out, dy.double())
    return xd.grad, wd.grad


@pytest.mark.parametrize(
    "dtype, prepared, dx_route",
    [
        (torch.bfloat16, False, "npu_grouped_matmul (dx)"),
        (torch.float16, True, "kernels_ascend.matmul per expert"),  # k-major w: not copied per call
        (torch.float32, False, "kernels_ascend.matmul per expert"),
    ],
)
def test_gradients_match_a_float64_per_expert_loop(backend, dtype, prepared, dx_route):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(13, 32, generator=g) * 32**-0.5).to(dtype)
    w = torch.randn(4, 24, 32, generator=g).to(dtype)
    dy = torch.randn(13, 24, generator=g).to(dtype)
    ws = backend.prepare("grouped_matmul", w=w)["w"] if prepared else w.clone()
    assert ws.is_contiguous() != prepared
    ws.requires_grad_()
    xs = x.clone().requires_grad_()
    backend.grouped_matmul(xs, ws, OFFS).backward(dy)
    want_dx, want_dw = _oracle(x, w, dy)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(xs.grad.double(), want_dx, rtol=rtol, atol=atol)
    torch.testing.assert_close(ws.grad.double(), want_dw, rtol=rtol, atol=atol)
    assert not ws.grad[1].any()
    routes = [r for (op, r) in backend.provider.routes if op == "grouped_matmul.backward"]
    assert len(routes) == 1 and dx_route in routes[0], routes
