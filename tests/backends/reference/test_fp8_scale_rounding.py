"""SPEC 7.8's claim about DeepSeek's TileLang `act_quant`, which multiplies amax by fl(1/448) where the
contract divides by 448: over a whole binade of fp32 amax values (all 2^23), the UE8M0 power is the same
either way, while the plain scales differ by one ulp for the share the spec quotes."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from backends.reference.fp8_format import E4M3_MAX, group_scale, pow2_ceil

SPEC = Path(__file__).resolve().parents[3] / "docs" / "spec.md"


def _binade(exponent: int) -> torch.Tensor:
    """Every fp32 value in [2**exponent, 2**(exponent + 1))."""
    bits = torch.arange(2**23, dtype=torch.int32) | ((127 + exponent) << 23)
    return bits.view(torch.float32)


def _deepseek_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)  # fl(1/448), then an fp32 product


def test_seven_times_the_rounded_reciprocal_is_exact():
    seven = torch.tensor([7.0])
    assert _deepseek_scale(seven).item() == 2.0**-6 == (seven / E4M3_MAX).item()


def test_ue8m0_power_is_the_same_for_every_amax_of_a_binade():
    for exponent in (0, -9):  # the rounding pattern repeats binade by binade (no subnormals here)
        amax = _binade(exponent)
        ours = group_scale(amax, eps=0.0, ue8m0=True)
        assert torch.equal(ours, pow2_ceil(_deepseek_scale(amax)))


def test_without_ue8m0_the_scales_differ_by_one_ulp_for_the_share_the_spec_quotes():
    amax = _binade(0)
    ours = group_scale(amax, eps=0.0, ue8m0=False)
    theirs = _deepseek_scale(amax)
    ulps = (ours.view(torch.int32) - theirs.view(torch.int32)).abs()
    assert int(ulps.max()) == 1
    share = (ulps != 0).double().mean().item()
    section = SPEC.read_text().split("### 7.8", 1)[1].split("\n## ", 1)[0]
    quoted = re.search(r"differ by one ulp for ([\d.]+)% of the\s+amax values of a binade", section)
    assert quoted, "SPEC 7.8 no longer quotes the share of amax values whose plain scales differ"
    assert round(100 * share, 1) == float(quoted.group(1))
