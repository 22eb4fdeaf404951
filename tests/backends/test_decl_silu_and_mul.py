"""silu_and_mul (SPEC 2.10), the op docs/adding-an-op.md adds through its declaration: the reference
against float64 autograd, the cpu backend bitwise the reference (forward and backward), the front door's
gradient through the generated custom op, and bad input refused with one line naming x."""

from __future__ import annotations

import pytest
import torch

import backends
from backends.reference.silu_and_mul import silu_and_mul as reference
from backends.reference.silu_and_mul import silu_and_mul_backward as reference_backward


def _x(dt: torch.dtype, m: int = 6, n: int = 40) -> torch.Tensor:
    return (torch.randn(m, 2 * n, generator=torch.Generator().manual_seed(m * n)) * 4).to(dt)


def test_reference_is_silu_of_gate_times_up_and_its_backward_is_autograds():
    x = _x(torch.float32).double().requires_grad_()
    gate, up = x[:, :40], x[:, 40:]
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(reference(x.detach().float()).double(), want.detach(), rtol=1e-6, atol=1e-6)
    dy = torch.randn(6, 40, dtype=torch.float64)
    (want * dy).sum().backward()
    got = reference_backward({"x": x.detach()}, (None,), (dy,))[0]
    torch.testing.assert_close(got.double(), x.grad, rtol=1e-5, atol=1e-5)  # the reference works in fp32


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_is_bitwise_the_reference_forward_and_backward(dt):
    cpu, ref = backends.get("cpu"), backends.get("reference")
    x, dy = _x(dt), torch.randn(6, 40).to(dt)
    before = cpu.calls.copy()
    grads = []
    for be in (cpu, ref):
        xi = x.clone().requires_grad_()
        out = be.silu_and_mul(xi)  # the custom op, its autograd and its backward op, generated
        out.backward(dy)
        grads.append((out.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    ran = cpu.calls - before
    assert ran["silu_and_mul"] == 1 and ran["silu_and_mul.backward"] == 1  # the forward runs once


def test_strided_empty_and_bad_input():
    cpu = backends.get("cpu")
    x = _x(torch.float32)
    # to rounding, not bitwise: torch's sigmoid takes a vector exp in a buffer's body and a scalar one in its
    # tail, and a strided view puts other elements in the tail (it differed on an AMD EPYC, 2026-12-04)
    torch.testing.assert_close(
        cpu.silu_and_mul(x[:, ::2]), cpu.silu_and_mul(x[:, ::2].contiguous()), rtol=4e-7, atol=1e-7
    )
    assert cpu.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match=r"^x: expected an even last dimension"):
        cpu.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"^x: expected"):
        cpu.silu_and_mul(torch.ones(3, 8, dtype=torch.int64))


def test_a_compiled_call_is_one_custom_op_node():
    ref = backends.get("reference")
    x = _x(torch.float32)
    compiled = torch.compile(ref.silu_and_mul, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), reference(x))
