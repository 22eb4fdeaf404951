"""GLM5_VALIDATE=reference: a backend's every call is compared with the reference."""

import pytest
import torch

from backends import Backend, OpCaps, OpImpl
from backends.counters import REFERENCE_CALLS
from backends.shadow import ShadowMismatch


def _quant_half_away(x):
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    y = xf / scale[:, None]
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


def _quant_even(x):
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _make(fn):
    class Shadowed(Backend):
        name = "shadowed"
        ops = {"dynamic_quant_int8": OpImpl(fn, OpCaps(("float32",)))}

    return Shadowed()


def test_mismatch_is_raised_with_the_first_difference(monkeypatch):
    monkeypatch.setenv("GLM5_VALIDATE", "reference")
    x = torch.tensor([[0.5, 127.0, -2.5, 1.0]])  # scale 1: 0.5 and -2.5 are half-way cases
    with pytest.raises(
        ShadowMismatch, match=r"shadowed.dynamic_quant_int8 output 0: first difference at \[0, 0\]"
    ):
        _make(_quant_half_away).dynamic_quant_int8(x)


def test_matching_backend_passes_and_leaves_reference_counters(monkeypatch):
    monkeypatch.setenv("GLM5_VALIDATE", "reference")
    before = REFERENCE_CALLS.copy()
    x_q, _ = _make(_quant_even).dynamic_quant_int8(torch.randn(4, 16))
    assert x_q.dtype == torch.int8
    assert REFERENCE_CALLS == before


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("GLM5_VALIDATE", raising=False)
    _make(_quant_half_away).dynamic_quant_int8(torch.tensor([[0.5, 127.0]]))  # wrong, but not checked
