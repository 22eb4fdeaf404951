"""Per-row dynamic int8 quantization (SPEC 2.5): hand cases incl. round-half-even, a numpy oracle,
the dequantisation error bound and row independence.

Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import backends
from backends.reference.dynamic_quant_int8 import dynamic_quant_int8


def numpy_quant(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Oracle in numpy fp32: np.rint rounds half to even."""
    xf = x.float().numpy()
    scale = np.maximum(np.abs(xf).max(axis=1, initial=0.0), np.float32(1e-10)).astype(
        np.float32
    ) / np.float32(127)
    q = np.clip(np.rint(xf / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def test_half_way_values_round_to_even():
    # amax 127 -> scale exactly 1.0, so x / scale is x itself
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, -126.5]])
    x_q, scale = dynamic_quant_int8(x)
    assert scale.tolist() == [1.0]
    assert x_q.tolist() == [[127, 0, 2, 2, -2, 0, 4, -126]]
    assert x_q.dtype == torch.int8 and scale.dtype == torch.float32


def test_negative_amax_all_zero_row_and_never_minus_128():
    x = torch.tensor([[-254.0, 1.0, 3.0], [0.0, 0.0, -0.0], [-1.0, 1.0, -1.0]])
    x_q, scale = dynamic_quant_int8(x)
    assert x_q.tolist() == [[-127, 0, 2], [0, 0, 0], [-127, 127, -127]]  # 1/2 -> 0, 3/2 -> 2
    assert scale[0].item() == 2.0 and scale[1].item() == pytest.approx(1e-10 / 127, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_numpy_oracle_bitwise(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=gen) * torch.logspace(-3, 3, 64)[:, None]).to(dtype)
    x_q, scale = backends.get("reference").dynamic_quant_int8(x)
    want_q, want_s = numpy_quant(x)
    assert np.array_equal(x_q.numpy(), want_q) and np.array_equal(scale.numpy(), want_s)


@settings(max_examples=100, deadline=None)
@given(
    arrays(
        np.float32,
        st.tuples(st.integers(0, 6), st.integers(1, 20)),
        elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    )
)
def test_fuzz_oracle_error_bound_and_row_independence(a):
    x = torch.from_numpy(a.copy())
    x_q, scale = dynamic_quant_int8(x)
    want_q, want_s = numpy_quant(x)
    assert np.array_equal(x_q.numpy(), want_q) and np.array_equal(scale.numpy(), want_s)
    assert (x_q.to(torch.int16) >= -127).all()
    # dequantisation error at most half a step (plus the fp32 rounding of x / scale)
    err = (x.double() - x_q.double() * scale.double()[:, None]).abs()
    assert (err <= scale.double()[:, None] * (0.5 + 1e-6)).all()
    for r in range(x.shape[0]):
        q1, s1 = dynamic_quant_int8(x[r : r + 1])
        assert torch.equal(q1[0], x_q[r]) and torch.equal(s1[0], scale[r])
