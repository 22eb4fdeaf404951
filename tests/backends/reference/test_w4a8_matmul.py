"""W4A8 GEMM (SPEC 2.7): the nibble packing (incl. -8 in both nibbles), a hand case, exact per-group
int32 parts, and agreement with an fp64 dequantised matmul within one ulp of out_dtype (budget as in
test_w8a8_matmul.py, with one more fp32 rounding per group).

Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.w4a8_matmul import pack_int4, unpack_int4, w4a8_matmul
from backends.reference.w8a8_matmul import w8a8_matmul
from tests.backends.reference._cases import ulp

OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_packing_by_hand():
    w = torch.tensor([[-8, -8, -8, 7, 7, -8, -1, 0, 0, -1, 3, -4]])
    packed = pack_int4(w)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x88, 0x78, 0x87, 0x0F, 0xF0, 0xC3]]  # low nibble = even k
    assert torch.equal(unpack_int4(packed), w.to(torch.int8))


def test_every_byte_round_trips():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None, :]
    w = unpack_int4(b)
    assert w.shape == (1, 512) and int(w.min()) == -8 and int(w.max()) == 7
    lo, hi = w[0, 0::2].to(torch.int32), w[0, 1::2].to(torch.int32)
    assert torch.equal((lo & 15) | ((hi & 15) << 4), torch.arange(256, dtype=torch.int32))
    assert torch.equal(pack_int4(w), b)


@pytest.mark.parametrize("bad", [[[-9, 0]], [[8, 0]], [[1, 2, 3]]])
def test_pack_rejects_out_of_range_or_odd(bad):
    with pytest.raises(ValueError, match="^w: expected"):
        pack_int4(torch.tensor(bad))


def test_hand_case_groups():
    x_q = torch.tensor([[1, 2, -3, 4]], dtype=torch.int8)
    w = pack_int4(torch.tensor([[-8, -8, 7, -1]]))
    # acc_g0 = 1*-8 + 2*-8 = -24, acc_g1 = -3*7 + 4*-1 = -25; out = 2 * (-24 * 0.5 + -25 * 2) = -124
    for dt in OUT_DTYPES:
        out = w4a8_matmul(x_q, torch.tensor([2.0]), w, torch.tensor([[0.5, 2.0]]), 2, out_dtype=dt)
        assert out.dtype == dt and out.tolist() == [[-124.0]]
    out = w4a8_matmul(
        x_q,
        torch.tensor([2.0]),
        w,
        torch.tensor([[0.5, 2.0]]),
        2,
        torch.tensor([0.25]),
        out_dtype=torch.float32,
    )
    assert out.tolist() == [[-123.75]]


def test_int32_part_exact_per_channel():
    x_q = torch.full((2, 4096), -128, dtype=torch.int8)
    x_q[1, 1::2] = 127
    w = torch.full((3, 4096), -8, dtype=torch.int8)
    w[1, ::3] = 7
    out = w4a8_matmul(x_q, torch.ones(2), pack_int4(w), torch.ones(3, 1), 4096, out_dtype=torch.float32)
    exact = x_q.numpy().astype(np.int64) @ w.numpy().astype(np.int64).T
    assert np.array_equal(out.numpy(), exact.astype(np.float32))


def dequant_fp64(x_q, x_scale, w, w_scale, group_size, bias):
    ws = w_scale.double().repeat_interleave(group_size, dim=1)  # [N, K]
    prod = (x_q.double() * x_scale.double()[:, None]) @ (w.double() * ws).T
    mag = (x_q.double().abs() * x_scale.double()[:, None]) @ (w.double() * ws).abs().T
    b = bias.double()[None, :] if bias is not None else torch.zeros(1, w.shape[0], dtype=torch.float64)
    return prod + b, mag + b.abs()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 5),
    st.integers(1, 5),
    st.integers(1, 6),
    st.sampled_from([2, 4, 8]),
    st.sampled_from(OUT_DTYPES),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_fuzz_one_ulp_of_fp64_dequantised(m, n, groups, group_size, out_dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    k = groups * group_size
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, generator=gen) + 1e-3, torch.rand(n, groups, generator=gen) + 1e-3
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = backends.get("reference").w4a8_matmul(
        x_q, x_scale, pack_int4(w), w_scale, group_size, bias, out_dtype=out_dtype
    )
    ref, mag = dequant_fp64(x_q, x_scale, w, w_scale, group_size, bias)
    budget = ulp(ref, out_dtype) + (groups + 3) * 2.0**-24 * mag
    assert ((out.double() - ref).abs() <= budget).all()


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_per_channel_equals_w8a8_on_unpacked_weights(out_dtype):
    gen = torch.Generator().manual_seed(2)
    x_q = torch.randint(-128, 128, (9, 64), generator=gen, dtype=torch.int8)
    w = torch.randint(-8, 8, (5, 64), generator=gen, dtype=torch.int8)
    xs, ws = torch.rand(9, generator=gen), torch.rand(5, generator=gen)
    a = w4a8_matmul(x_q, xs, pack_int4(w), ws[:, None], 64, out_dtype=out_dtype)
    b = w8a8_matmul(x_q, xs, w, ws, out_dtype=out_dtype)
    # same value, products in another order: (acc * xs) * ws vs xs * (acc * ws)
    ref, mag = dequant_fp64(x_q, xs, w, ws[:, None], 64, None)
    for out in (a, b):
        assert ((out.double() - ref).abs() <= ulp(ref, out_dtype) + 4 * 2.0**-24 * mag).all()
