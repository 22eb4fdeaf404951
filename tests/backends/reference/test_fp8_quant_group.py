"""fp8_quant_group (SPEC 7.1) against DeepSeek's `act_quant` and vLLM's `per_token_group_quant_fp8`,
restated here from their published formulas (not imported from the reference)."""

from __future__ import annotations

import math

import pytest
import torch

from backends.reference.fp8_format import pow2_ceil
from backends.reference.fp8_quant_group import fp8_quant_group


def deepseek_act_quant(x: torch.Tensor, eps: float, scale_fmt: str | None):
    """inference/kernel.py act_quant, per 128-column group (K % 128 == 0 as upstream asserts)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 128, 128)
    amax = g.abs().amax(dim=-1).clamp(min=eps)
    s = amax / 448.0
    if scale_fmt == "ue8m0":
        s = torch.tensor([[2.0 ** math.ceil(math.log2(v)) for v in row] for row in s.tolist()])
    y = torch.clamp(g / s[..., None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return y.reshape(m, k), s


@pytest.mark.parametrize("eps", [1e-4, 1e-10])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_matches_upstream_formula_bitwise(eps, ue8m0):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 384, generator=g) * torch.logspace(-6, 3, 7)[:, None]).bfloat16()
    x[3, :128] = 0  # an all-zero group: the floor decides the scale
    q, s = fp8_quant_group(x, 128, eps, ue8m0)
    rq, rs = deepseek_act_quant(x, eps, "ue8m0" if ue8m0 else None)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs.float())
    assert s[3, 0] == (pow2_ceil(torch.tensor(eps / 448)) if ue8m0 else torch.tensor(eps) / 448)


def test_rounds_half_to_even_and_saturates():
    # group amax 448 -> scale 1: values are cast as they are. 17 lies between 16 and 18 (ulp 2): tie -> 16;
    # 19 -> 20 (tie between 18 and 20 goes to the even mantissa 20)
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([448.0, 17.0, 19.0, -0.0])
    q, s = fp8_quant_group(x, 128, 1e-4, False)
    assert s.item() == 1.0
    assert q[0, :4].float().tolist() == [448.0, 16.0, 20.0, 0.0]


def test_partial_last_group_uses_its_own_columns():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 200, generator=g)
    x[:, 128:] *= 1e-3
    q, s = fp8_quant_group(x, 128, 1e-4, False)
    assert s.shape == (3, 2)
    torch.testing.assert_close(s[:, 1], x[:, 128:].abs().amax(dim=1) / 448, rtol=0, atol=0)
    # the same as padding the row with zeros to a full group
    qp, sp = fp8_quant_group(torch.nn.functional.pad(x, (0, 56)), 128, 1e-4, False)
    assert torch.equal(q.view(torch.uint8), qp[:, :200].view(torch.uint8)) and torch.equal(s, sp)


def test_round_trip_error_is_half_an_e4m3_ulp():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=g)
    q, s = fp8_quant_group(x, 128, 1e-4, False)
    deq = q.float() * s.repeat_interleave(128, dim=1)
    # normal e4m3 values carry 3 mantissa bits: relative error <= 2^-4; subnormals: absolute 2^-10 * s
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * s.repeat_interleave(128, dim=1))
    assert ((deq - x).abs() <= bound).all()


def test_ue8m0_scale_is_the_next_power_of_two_up():
    s = torch.tensor([1.0, 1.5, 0.75, 2.0**-20, 3.0 * 2**-130])
    assert pow2_ceil(s).tolist() == [1.0, 2.0, 1.0, 2.0**-20, 2.0**-128]
