"""cuda silu_and_mul (SPEC 2.10): forward to SPEC 4's default tolerance of the reference, backward to the
gradient tolerance (its 1 + g * (1 - s) cancels near g = -1.28), one launch each,
strided input, empty batch; trains through autograd (the declared backward).

Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)
"""

from __future__ import annotations

import pytest
import torch

from backends.reference.silu_and_mul import silu_and_mul as reference
from backends.reference.silu_and_mul import silu_and_mul_backward as reference_backward
from conformance.compare import DEFAULT_TOL, GRAD_TOL
from tests.backends.cuda.conftest import skip_bf16_interpreted


def _within(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = DEFAULT_TOL[str(want.dtype).removeprefix("torch.")]
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 96), (33, 700)])
def test_forward_and_backward_within_tolerance(cuda, device, launches, dtype, m, n):
    skip_bf16_interpreted(dtype)
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = (torch.randn(m, 2 * n, generator=g) * 3).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    xd = x.to(device).requires_grad_()
    out = cuda.silu_and_mul(xd)
    _within(out.detach(), reference(x))
    out.backward(dy.to(device))
    rtol, atol = GRAD_TOL[str(dtype).removeprefix("torch.")]
    torch.testing.assert_close(
        xd.grad.cpu(), reference_backward({"x": x}, (None,), (dy,))[0], rtol=rtol, atol=atol
    )
    assert launches()["silu_and_mul"] == 1 and launches()["silu_and_mul.backward"] == 1


def test_strided_and_empty(cuda, device):
    base = torch.randn(4, 40)
    x = base[:, ::2]  # [4, 20], column stride 2
    _within(cuda.silu_and_mul(x.to(device) if device == "cpu" else x.cuda()), reference(x))
    assert cuda.silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
