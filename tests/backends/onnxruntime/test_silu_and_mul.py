"""silu_and_mul on ONNX Runtime: the reference within tolerance (its own Sigmoid); refused under autograd."""

from __future__ import annotations

import pytest
import torch

from backends.errors import NotSupported


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_with_saturated_gates(be, ref, no_fallback, dtype):
    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3))
    x[0, :48] = torch.linspace(-60, 60, 48)  # sigmoid 0 and 1 at the ends
    x = x.to(dtype)
    out, want = be.silu_and_mul(x), ref.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (5, 48)
    # ORT's Sigmoid is its own fp32 approximation (0 far in the negative tail, where the reference has
    # ~1e-26): the default tolerance of the dtype (SPEC 4), not bits
    torch.testing.assert_close(out, want)
    assert be.kernel_calls()["silu_and_mul"] >= 1
    no_fallback(ref_calls_allowed=1)


def test_requires_grad_is_refused_with_a_reason(be):
    with pytest.raises(NotSupported, match="inference only"):
        be.silu_and_mul(torch.randn(3, 8, requires_grad=True))
    with torch.no_grad():
        assert be.silu_and_mul(torch.randn(3, 8, requires_grad=True)).shape == (3, 4)
