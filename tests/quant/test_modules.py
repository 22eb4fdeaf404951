"""Quantized modules compute through the backend ops (SPEC 2.5-2.8) and equal the reference composition."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import backends
from backends.reference.dynamic_quant_int8 import dynamic_quant_int8
from backends.reference.w4a8_matmul import pack_int4, w4a8_matmul
from backends.reference.w8a8_matmul import w8a8_matmul
from quant.modules import QuantExperts, QuantLinear
from quant.quantizers import quantize_weight
from quant.recipe import W4A8, W8A8, Scheme
from tests.quant.conftest import ids, tiny_model


@pytest.mark.parametrize("scheme", [Scheme(W8A8), Scheme(W4A8), Scheme(W4A8, 16)])
def test_quant_linear_is_dynamic_quant_plus_matmul(scheme):
    be = backends.get("reference")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    q, s = quantize_weight(w, scheme.bits, scheme.group_size)
    mod = QuantLinear.from_int(q, s, scheme, be)
    before = Counter(be.calls)
    got = mod(x)
    calls = be.calls - before
    assert got.shape == (2, 5, 24) and got.dtype == x.dtype
    xq, xs = dynamic_quant_int8(x.reshape(-1, 64))
    if scheme.name == W8A8:
        want = w8a8_matmul(xq, xs, q, s[:, 0], out_dtype=torch.float32)
    else:
        want = w4a8_matmul(xq, xs, mod.weight, s, scheme.group_size or 64, out_dtype=torch.float32)
    assert torch.equal(got.reshape(-1, 24), want)
    assert torch.equal(mod.int_weight()[0], q)
    matmul = "w8a8_matmul" if scheme.name == W8A8 else "w4a8_matmul"
    assert calls == Counter({"dynamic_quant_int8": 1, matmul: 1})


@pytest.mark.parametrize("scheme", [Scheme(W8A8), Scheme(W4A8), Scheme(W4A8, 16)])
def test_quant_experts_equal_per_token_loop(scheme):
    """Grouped GEMMs over expert-sorted rows equal a per-(token, slot) loop of the single-matrix ops."""
    be = backends.get("reference")
    g = torch.Generator().manual_seed(1)
    e, d, i, t, k = 4, 32, 16, 9, 2
    ex = QuantExperts(e, d, i, scheme)
    ws = {}
    for j in range(e):
        for p, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            q, s = quantize_weight(torch.randn(*shape, generator=g), scheme.bits, scheme.group_size)
            ex.set_int(j, p, q, s)
            ws[j, p] = (q, s)
            assert torch.equal(ex.int_weight(j, p)[0], q)
    x = torch.randn(t, d, generator=g)
    # experts 1..3 only: expert 0 gets no rows, which grouped_matmul must allow
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] + 1 for _ in range(t)]).to(torch.int32)
    rw = torch.rand(t, k, generator=g)
    before = Counter(be.calls)
    got = ex(x, idx, rw, be)
    assert be.calls - before == Counter({"grouped_matmul": 2, "dynamic_quant_int8": 2, "silu_and_mul": 1})

    def lin(xr, j, p):
        q, s = ws[j, p]
        xq, xs = dynamic_quant_int8(xr)
        if scheme.name == W8A8:
            return w8a8_matmul(xq, xs, q, s[:, 0], out_dtype=torch.float32)
        return w4a8_matmul(xq, xs, pack_int4(q), s, scheme.group_size or q.shape[1], out_dtype=torch.float32)

    want = torch.zeros(t, d)
    for r in range(t):
        for c in range(k):
            j = int(idx[r, c])
            gate_up = torch.cat([lin(x[r : r + 1], j, p) for p in ("gate_proj", "up_proj")], dim=1)
            h = be.silu_and_mul(gate_up)
            want[r] += rw[r, c] * lin(h, j, "down_proj")[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_quantized_tiny_model_runs_on_backend_ops(w4a8_model):
    be = w4a8_model.backend
    before = Counter(be.calls)
    with torch.no_grad():
        out = w4a8_model(ids()).logits
    calls = be.calls - before
    assert torch.isfinite(out).all()
    for op in ("dynamic_quant_int8", "w8a8_matmul", "grouped_matmul"):
        assert calls[op] > 0, op
    float_out = tiny_model()(ids()).logits
    rel = (out - float_out).norm() / float_out.norm()
    assert 0 < rel < 0.2


def test_bad_scheme_and_group():
    be = backends.get("reference")
    with pytest.raises(ValueError, match="scheme"):
        QuantLinear(8, 8, Scheme("FLOAT"), be)
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear(24, 8, Scheme(W4A8, 16), be)
    with pytest.raises(ValueError, match="group_size"):
        QuantExperts(2, 32, 24, Scheme(W4A8, 16))


def test_scales_stay_fp32_under_a_bf16_default_dtype():
    """vLLM builds models under torch.set_default_dtype(bf16), and users cast models with .to(dtype): scales
    and biases must stay fp32 (the contract's dtype), or every quantized call is refused by the front door."""
    E4M3 = torch.float8_e4m3fn
    from backends import get
    from quant.fp8_modules import FP8Experts, FP8Linear
    from quant.modules import QuantExperts, QuantLinear
    from quant.recipe import W4A8, W8A8, Scheme

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        be = get("reference")
        mods = [
            QuantLinear(64, 32, Scheme(W8A8), be, bias=True),
            QuantLinear(64, 32, Scheme(W4A8, 32), be),
            QuantExperts(2, 64, 32, Scheme(W8A8)),
            QuantExperts(2, 64, 32, Scheme(W4A8)),
            FP8Linear(64, 32, be, bias=True),
            FP8Experts(2, 64, 32),
        ]
    finally:
        torch.set_default_dtype(before)
    for m in mods:
        scales = {n: b.clone() for n, b in m.named_buffers() if b.is_floating_point() and b.dtype != E4M3}
        assert scales and all(b.dtype == torch.float32 for b in scales.values()), type(m).__name__
        for n in scales:
            m.get_buffer(n).normal_()
        before = {n: m.get_buffer(n).clone() for n in scales}
        m.to(torch.bfloat16)  # the model's compute dtype; the scales stay fp32, bit for bit
        for n in scales:
            assert m.get_buffer(n).dtype == torch.float32 and torch.equal(m.get_buffer(n), before[n]), n
