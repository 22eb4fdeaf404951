"""dynamic_quant_int8: npu_dynamic_quant (bf16/fp16) with the contract's scale floor; fp32 kernel."""

from __future__ import annotations

import torch

from backends.ascend import dynamic_quant_int8 as mod


def _x(dtype):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1] = 0  # all-zero row
    x[2] = 1e-12  # amax below the 1e-10 floor
    return x


def test_matches_reference_bitwise(backend, reference):
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        a, r = backend.dynamic_quant_int8(_x(dt)), reference.dynamic_quant_int8(_x(dt))
        assert torch.equal(a[0], r[0]) and torch.equal(a[1], r[1]), dt


def test_missing_scale_floor_makes_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(mod, "floor_tiny_rows", lambda x, q, s: (q, s))
    a, r = backend.dynamic_quant_int8(_x(torch.bfloat16)), reference.dynamic_quant_int8(_x(torch.bfloat16))
    assert not torch.equal(a[1], r[1])
