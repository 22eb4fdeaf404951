"""grouped_matmul's float variant is differentiable in x and w (SPEC 2.8): each backend's declared
backward against torch autograd of a plain per-expert loop in float64, empty experts included; the
quantized variants carry no gradient; an inference-only backend refuses a call that wants one."""

from __future__ import annotations

import pytest
import torch

import backends
from backends.errors import NotSupported

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _oracle(x: torch.Tensor, w: torch.Tensor, counts: list[int], dy: torch.Tensor):
    """(dx, dw) by autograd of out[rows of e] = x[rows of e] @ w[e]^T, one expert at a time, in float64."""
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    offs = _offsets(counts).tolist()
    out = torch.cat([xd[offs[e] : offs[e + 1]] @ wd[e].T for e in range(len(counts))])
    torch.autograd.backward(out, dy.double())
    return xd.grad, wd.grad


def _inputs(counts, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(counts), k, generator=g) * k**-0.5).to(dtype)
    w = torch.randn(len(counts), n, k, generator=g).to(dtype)
    dy = torch.randn(sum(counts), n, generator=g)
    return x, w, dy


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_of_x_and_w_match_autograd_of_a_per_expert_loop(backend, dtype):
    counts = [3, 0, 5, 1, 0, 4]  # empty experts between and at the end
    x, w, dy = _inputs(counts, 24, 10, dtype)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = backends.get(backend).grouped_matmul(xs, ws, _offsets(counts))
    out.backward(dy.to(out.dtype))
    want_dx, want_dw = _oracle(x, w, counts, dy.to(dtype))
    rtol, atol = TOL[dtype]
    assert xs.grad.dtype == dtype and ws.grad.dtype == dtype
    torch.testing.assert_close(xs.grad.double(), want_dx, rtol=rtol, atol=atol)
    torch.testing.assert_close(ws.grad.double(), want_dw, rtol=rtol, atol=atol)
    assert not ws.grad[1].any() and not ws.grad[4].any()  # an expert with no rows gets a zero gradient


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fp32_output_strided_x_and_every_expert_empty(backend):
    be = backends.get(backend)
    counts = [4, 0, 3]
    x, w, dy = _inputs(counts, 16, 6, torch.bfloat16, seed=1)
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, ::2] = x
    leaf, ws = wide.clone().requires_grad_(), w.clone().requires_grad_()
    out = be.grouped_matmul(leaf[:, ::2], ws, _offsets(counts), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    out.backward(dy)
    want_dx, want_dw = _oracle(x, w, counts, dy)
    torch.testing.assert_close(leaf.grad[:, ::2].double(), want_dx, rtol=2e-2, atol=2e-2)
    assert not leaf.grad[:, 1::2].any()
    torch.testing.assert_close(ws.grad.double(), want_dw, rtol=2e-2, atol=2e-2)

    x0 = torch.zeros(0, 8, requires_grad=True)
    w0 = torch.randn(3, 4, 8, requires_grad=True)
    be.grouped_matmul(x0, w0, _offsets([0, 0, 0])).sum().backward()
    assert w0.grad is not None and not w0.grad.any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_declared_backward_runs_once_per_call_without_a_forward(backend):
    be = backends.get(backend)
    counts = [2, 3]
    x, w, _ = _inputs(counts, 8, 4, torch.float32)
    x.requires_grad_()
    be.calls.clear()
    be.grouped_matmul(x, w.requires_grad_(), _offsets(counts)).sum().backward()
    assert be.calls["grouped_matmul"] == 1 and be.calls["grouped_matmul.backward"] == 1


def test_quantized_variants_are_served_with_grad_enabled_and_carry_none():
    counts = [2, 0, 3]
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-127, 127, (5, 16), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 127, (3, 4, 16), generator=g, dtype=torch.int8)
    x_scale, w_scale = torch.rand(5, generator=g), torch.rand(3, 4, generator=g)
    out = backends.get("cpu").grouped_matmul(
        x, w, _offsets(counts), x_scale, w_scale, out_dtype=torch.float32
    )
    assert not out.requires_grad


def test_onnxruntime_refuses_a_call_that_wants_a_gradient():
    pytest.importorskip("onnxruntime")
    be = backends.get("onnxruntime")
    if not be.available()[0]:
        pytest.skip(be.available()[1])
    counts = [2, 3]
    x, w, _ = _inputs(counts, 8, 4, torch.float32)
    with pytest.raises(NotSupported, match="inference only"):
        be.grouped_matmul(x.requires_grad_(), w, _offsets(counts))
    with torch.no_grad():
        assert be.grouped_matmul(x, w, _offsets(counts)).shape == (5, 4)
