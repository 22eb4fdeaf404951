"""w8a8_matmul through the emulated npu_quant_matmul, including the 65535 last-dim split."""

from __future__ import annotations

import torch

from backends.ascend import w8a8_matmul as mod


def _args(k: int = 48):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(-128, 128, (5, k), generator=g, dtype=torch.int8),
        torch.rand(5, generator=g),
        torch.randint(-128, 128, (20, k), generator=g, dtype=torch.int8),
        torch.rand(20, generator=g),
    )


def test_matches_reference_within_one_ulp(backend, reference):
    b = torch.randn(20)
    a, r = backend.w8a8_matmul(*_args(), b), reference.w8a8_matmul(*_args(), b)
    ulp = torch.finfo(torch.bfloat16).eps * r.float().abs().clamp_min(1e-30)
    assert bool(((a.float() - r.float()).abs() <= ulp).all())


def test_wide_n_is_split_in_operator_sized_blocks(backend, reference, monkeypatch):
    monkeypatch.setattr(mod, "QMM_MAX_LAST_DIM", 8)  # stand-in for 65535
    assert torch.equal(backend.w8a8_matmul(*_args(8)), reference.w8a8_matmul(*_args(8)))
    assert backend.provider.calls["npu_quant_matmul"] == 3


def test_outputs_outside_the_operator_table_run_the_kernel_bitwise(backend, reference):
    b = torch.randn(20)
    for dt, bias in ((torch.float32, b), (torch.float32, None), (torch.float16, b.half())):
        assert torch.equal(backend.w8a8_matmul(*_args(), bias, dt), reference.w8a8_matmul(*_args(), bias, dt))
    assert backend.provider.calls["npu_quant_matmul"] == 0
