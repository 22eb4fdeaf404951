"""silu_and_mul: npu_swiglu on [gate | up] (the documented operator's emulation here); backward."""

from __future__ import annotations

import pytest
import torch

from backends.ascend.emulation import OperatorRejected, module_for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_through_the_operator(backend, reference, dtype):
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = backend.kernel_calls()["npu_swiglu"]
    out = backend.silu_and_mul(x)
    torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=0, atol=0)
    assert backend.kernel_calls()["npu_swiglu"] == calls + 1
    assert "npu_swiglu" in backend.environment()["routes"]
    assert backend.silu_and_mul(x[:0]).shape == (0, 40)  # the operator takes no empty tensor


def test_backward_is_the_contracts(backend, reference):
    x = torch.randn(4, 16, requires_grad=True)
    dy = torch.randn(4, 8)
    (got,) = torch.autograd.grad(backend.silu_and_mul(x), x, dy)
    (want,) = torch.autograd.grad(reference.silu_and_mul(x), x, dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_emulation_rejects_what_the_docs_exclude():
    a3 = module_for("A3")
    with pytest.raises(OperatorRejected, match="even"):
        a3.npu_swiglu(torch.randn(2, 5))
    with pytest.raises(OperatorRejected, match="non-empty"):
        a3.npu_swiglu(torch.randn(0, 4))
    with pytest.raises(OperatorRejected, match="dtype"):
        a3.npu_swiglu(torch.randn(2, 4, dtype=torch.float64))
