"""Weight quantizers: scale conventions, range handling, SSZ and GPTQ improve what they claim to."""

from __future__ import annotations

import pytest
import torch

from quant.gptq import Hessian, gptq_quantize
from quant.quantizers import dequantize, minmax_scale, quantize_weight, round_to_int, ssz_refine


def _w(n: int = 16, k: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "bits,conv,div", [(8, "qmax", 127.0), (4, "qmax", 7.0), (8, "half_range", 127.5), (4, "half_range", 7.5)]
)
def test_minmax_divisors(bits, conv, div):
    w = _w()
    torch.testing.assert_close(minmax_scale(w, bits, None, conv)[:, 0], w.abs().amax(1) / div)


def test_round_half_even_and_clamp():
    w = torch.tensor([[7.0, 2.5, -2.5, 0.5, -7.0, 1.5, 0.0, 3.5]])  # absmax 7: scale 1 (qmax, int4)
    q, s = quantize_weight(w, 4)
    assert s.item() == 1.0
    assert q.tolist() == [[7, 2, -2, 0, -7, 2, 0, 4]]


def test_half_range_int4_produces_minus_eight():
    """absmax / 7.5: the negative extreme lands on -7.5 and rounds (half to even) to -8, which is legal."""
    w = torch.tensor([[-7.5, 1.0, 2.0, 7.0]])
    q, s = quantize_weight(w, 4, convention="half_range")
    assert s.item() == 1.0 and q[0, 0].item() == -8


def test_per_group_scales_shape_and_bad_group():
    q, s = quantize_weight(_w(), 4, group_size=16)
    assert s.shape == (16, 4) and q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(_w(), 4, group_size=24)
    with pytest.raises(ValueError, match="convention"):
        quantize_weight(_w(), 4, convention="x")


def test_ssz_never_worse_than_minmax():
    w = _w(32, 128, seed=1)
    s0 = minmax_scale(w, 4)
    s1 = ssz_refine(w, s0, 4, 10)

    def err(s: torch.Tensor) -> torch.Tensor:
        return (w - dequantize(round_to_int(w, s, 4), s)).pow(2).sum(1)

    assert bool((err(s1) <= err(s0) + 1e-6).all())
    assert float(err(s1).sum()) < float(err(s0).sum())


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 64, generator=g)
    x = x + 0.1 * torch.randn(512, 64, generator=g)
    w = _w(32, 64, seed=3)
    h = Hessian(64)
    h.add(x[:256])
    h.add(x[256:])
    torch.testing.assert_close(h.h, 2 * x.double().T @ x.double() / 512)
    for gs in (None, 16):
        q_rtn, s_rtn = quantize_weight(w, 4, gs)
        q_g, s_g = gptq_quantize(w, h.h, 4, gs)
        assert int(q_g.min()) >= -8 and int(q_g.max()) <= 7
        e_rtn = (x @ (w - dequantize(q_rtn, s_rtn)).T).pow(2).mean()
        e_g = (x @ (w - dequantize(q_g, s_g)).T).pow(2).mean()
        assert e_g < 0.8 * e_rtn
