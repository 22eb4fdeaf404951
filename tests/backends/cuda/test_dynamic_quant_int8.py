"""cuda dynamic_quant_int8: bitwise equal to the reference (RNE ties, correctly rounded division), tiles.

Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
"""

from __future__ import annotations

import pytest
import torch

from backends.reference.dynamic_quant_int8 import dynamic_quant_int8 as reference

# bf16 is only loaded and widened (exactly) to fp32, so even the interpreter serves it bitwise
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("m,k", [(1, 1), (3, 7), (17, 300), (5, 1500), (40, 33)])
def test_bitwise_equal_to_reference(cuda, device, m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    for dt in DTYPES:
        x = (torch.randn(m, k, generator=g) * 3).to(dt)
        x_q, scale = cuda.dynamic_quant_int8(x.to(device))
        r_q, r_scale = reference(x)
        assert torch.equal(x_q.cpu(), r_q), dt
        assert torch.equal(scale.cpu(), r_scale), dt


def test_ties_round_half_to_even(cuda, device):
    # amax 127 -> scale exactly 1, amax 254 -> scale 2: quotients land exactly on .5
    x = torch.tensor(
        [[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, -3.5, 126.5], [254.0, 1.0, 3.0, 5.0, -5.0, -1.0, -7.0, 253.0]]
    )
    x_q, scale = cuda.dynamic_quant_int8(x.to(device))
    assert scale.cpu().tolist() == [1.0, 2.0]
    assert x_q.cpu().tolist() == [[127, 0, 2, 2, -2, 0, -4, 126], [127, 0, 2, 2, -2, 0, -4, 126]]


def test_zero_rows_tiny_rows_and_strided_input(cuda, device):
    x = torch.zeros(3, 20)
    x[1, 3] = 1e-12  # below the 1e-10 floor
    x[2] = torch.linspace(-4, 4, 20)
    wide = torch.zeros(3, 40)
    wide[:, ::2] = x  # strided columns
    x_q, scale = cuda.dynamic_quant_int8(wide[:, ::2].to(device))
    r_q, r_scale = reference(x)
    assert torch.equal(x_q.cpu(), r_q) and torch.equal(scale.cpu(), r_scale)
    assert x_q[0].abs().sum() == 0


def test_one_kernel_launch_and_empty_m(cuda, device, launches):
    cuda.dynamic_quant_int8(torch.ones(2, 8, device=device))
    assert launches() == {"dynamic_quant_int8": 1}
    x_q, scale = cuda.dynamic_quant_int8(torch.ones(0, 8).to(device))
    assert x_q.shape == (0, 8) and scale.shape == (0,)


def test_bad_input_names_the_argument(cuda, device):
    with pytest.raises(ValueError, match="^x: expected"):
        cuda.dynamic_quant_int8(torch.ones(2, 3, dtype=torch.int32).to(device))


def test_divides_rather_than_multiplying_by_the_reciprocal(cuda, device):
    # Rows whose x * (1 / scale) rounds differently from x / scale (found by search, fp32 throughout):
    # a kernel using the reciprocal or an approximate divide flips these elements by one.
    g = torch.Generator().manual_seed(7)
    amax = torch.rand(4096, generator=g) * 10 + 0.1
    x = torch.rand(4096, 64, generator=g) * amax[:, None]
    x[:, 0] = amax
    scale = amax / 127
    differs = (torch.round(x / scale[:, None]) != torch.round(x * (1 / scale)[:, None])).any(dim=1)
    rows = x[differs][:32]
    assert rows.shape[0] > 0
    x_q, _ = cuda.dynamic_quant_int8(rows.to(device))
    assert torch.equal(x_q.cpu(), reference(rows)[0])
