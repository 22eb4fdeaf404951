"""MoE grouped GEMM (SPEC 2.8): a hand case with an empty expert, equality with a per-expert loop of
the single GEMMs (bitwise for W8A8 / W4A8, fp64 loop for float weights), empty experts, and token
order inside an expert.

Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.grouped_matmul import grouped_matmul
from backends.reference.w4a8_matmul import pack_int4, w4a8_matmul
from backends.reference.w8a8_matmul import w8a8_matmul

TOL = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(sizes[: i + 1]) for i in range(len(sizes))], dtype=torch.int32)


def test_hand_case_with_empty_expert():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    w = torch.tensor(
        [
            [[1.0, 0.0], [0.0, 1.0]],  # expert 0: identity
            [[9.0, 9.0], [9.0, 9.0]],  # expert 1: empty
            [[2.0, -2.0], [1.0, 1.0]],
        ]
    )  # expert 2
    out = grouped_matmul(x, w, offsets([2, 0, 1]))
    assert out.tolist() == [[1.0, 2.0], [3.0, -1.0], [0.0, 1.0]]


def _float_case(sizes, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=gen).to(dtype)
    w = torch.randn(len(sizes), n, k, generator=gen).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_equals_per_expert_fp64_loop(dtype):
    sizes = [5, 0, 17, 1, 0, 9]
    x, w = _float_case(sizes, 12, 40, dtype, 0)
    out = backends.get("reference").grouped_matmul(x, w, offsets(sizes))
    assert out.dtype == dtype
    want, r0 = torch.empty(sum(sizes), 12, dtype=torch.float64), 0
    for e, s in enumerate(sizes):
        want[r0 : r0 + s] = x[r0 : r0 + s].double() @ w[e].double().T
        r0 += s
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=rtol, atol=atol)


def _quant_case(sizes, n, k, seed, int4):
    gen = torch.Generator().manual_seed(seed)
    m, e = sum(sizes), len(sizes)
    x = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    xs = torch.rand(m, generator=gen)
    if int4:
        w = pack_int4(torch.randint(-8, 8, (e, n, k), generator=gen))
        ws = torch.rand(e, n, k // 8, generator=gen)
    else:
        w = torch.randint(-128, 128, (e, n, k), generator=gen, dtype=torch.int8)
        ws = torch.rand(e, n, generator=gen)
    return x, xs, w, ws


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int4", [False, True])
def test_quantized_equals_per_expert_loop_bitwise(out_dtype, int4):
    sizes = [3, 0, 11, 1, 6]
    x, xs, w, ws = _quant_case(sizes, 7, 32, 1, int4)
    gs = 8 if int4 else None
    out = backends.get("reference").grouped_matmul(x, w, offsets(sizes), xs, ws, gs, out_dtype)
    r0 = 0
    for e, s in enumerate(sizes):
        r = slice(r0, r0 + s)
        one = (
            w4a8_matmul(x[r], xs[r], w[e], ws[e], 8, out_dtype=out_dtype)
            if int4
            else w8a8_matmul(x[r], xs[r], w[e], ws[e], out_dtype=out_dtype)
        )
        assert torch.equal(out[r], one)
        r0 += s


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.sampled_from(["float", "w8a8", "w4a8"]),
    st.integers(0, 2**16),
)
def test_fuzz_token_order_inside_an_expert_and_empty_experts(sizes, variant, seed):
    """Permuting rows inside each expert permutes the output rows, bitwise; all-empty batches work."""
    gen = torch.Generator().manual_seed(seed)
    if variant == "float":
        x, w = _float_case(sizes, 4, 16, torch.float32, seed)
        extra: tuple = ()
    else:
        x, xs, w, ws = _quant_case(sizes, 4, 16, seed, variant == "w4a8")
        extra = (xs, ws, 8 if variant == "w4a8" else None, torch.bfloat16)
    offs = offsets(sizes)
    perm = torch.cat(
        [o + torch.randperm(s, generator=gen) for o, s in zip(offs.tolist(), sizes, strict=False)]
    ).long()
    out = grouped_matmul(x, w, offs, *extra)
    permuted_extra = (extra[0][perm],) + extra[1:] if extra else ()
    out_p = grouped_matmul(x[perm], w, offs, *permuted_extra)
    assert out.shape == (sum(sizes), 4)
    assert torch.equal(out_p, out[perm])
