"""The layout-invariant mode's Triton engine (kernels_cuda/invariant_gemm.py, SPEC 12): int8 digit products
by `tl.dot` with int32 accumulation, folded into int64, give the int64 engine's integers bitwise. Every
product and sum is an exact integer, so a bitwise check under the interpreter tests the kernel's logic
(tiles, masks, the pairs of each level, the fold) the way a GPU runs it; the s8 MMA itself is the
compiler's (bench/gpu/compile_invariant_gemm.py compiles the kernel for sm_90: about 30 s, too slow here).
"""

from __future__ import annotations

import pytest
import torch

from backends.invariant import engine as num
from backends.invariant import gemm
from kernels_cuda.invariant_gemm import digit_product


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 1, 1),
        (3, 13, 5),  # K below one block
        (17, 300, 70),  # K not a multiple of the block, M and N over one tile
        (70, 33, 130),
        (2, 2048, 3),  # GLM-5's K: selected keys, an expert's intermediate
        (2, 6144, 3),  # the hidden size
        (2, 16384, 3),  # the dense intermediate
    ],
)
def test_the_kernel_gives_the_int64_engines_integers(device, launches, m, k, n):
    t = gemm.grid_bits(k)
    a = torch.randint(-(2**t), 2**t + 1, (m, k), generator=_g(k), dtype=torch.int32)
    b = torch.randint(-(2**t), 2**t + 1, (k, n), generator=_g(k + 1), dtype=torch.int32)
    a[0], b[:, 0] = 2**t, -(2**t)  # |P| reaches K 2^(2t), SPEC 12's bound
    want = gemm.int_product(a, gemm.b_form(b, "int64"), "int64", t)
    got = gemm.int_product(a.to(device), gemm.b_form(b.to(device), "triton"), "triton", t)
    assert launches()["invariant_gemm"] == 1
    assert torch.equal(got.cpu(), want)
    assert int(got[0, 0]) == -k * 4**t


def test_worst_case_digits_at_k_16384_accumulate_exactly_in_int32(device):
    """Digits of magnitude 64 and 63 (odd products where both are 63): the middle level sums 4 pairs over
    K = 16,384 to just under 2^28 in its int32 accumulator, an odd integer that fp32 cannot hold, so an
    fp32 accumulation (or any inexact one) in NumPy's int8 matmul under the interpreter, or in IMMA, fails
    this. P = sum_k v_a v_b (~2^68) passes int64, so the fold's two's-complement wrap is compared modulo
    2^64, which an inexact level sum would still break."""
    k, n = 16384, 2
    ks = torch.arange(k)
    a = torch.where(ks % 3 == 0, -63, -64).to(torch.int8).expand(4, 1, 2, k).clone()
    a[:, :, 1] = -a[:, :, 1]
    b = torch.where(ks % 5 == 0, -63, -64).to(torch.int8).expand(1, 4 * n, k).clone()
    middle = sum(int(x) for x in (a[0, 0, 0].long() * b[0, 0].long()).tolist()) * 4
    assert 2**27 < middle < 2**28 and float(torch.tensor(middle, dtype=torch.float32)) != middle
    got = digit_product(a.to(device), b.to(device), 7).cpu()
    weight = sum(
        1 << (7 * i) for i in range(4)
    )  # every digit of a column is the same: v = d (2^21 + ... + 1)
    for r in range(2):
        p = sum(x * y for x, y in zip(a[0, 0, r].tolist(), b[0, 0].tolist(), strict=True)) * weight * weight
        assert [int(x) for x in got[0, r]] == [(p + 2**63) % 2**64 - 2**63] * n


def test_exact_matmul_on_the_triton_engine_has_every_engines_bits(device):
    a, b = torch.randn(2, 3, 5, 40, generator=_g(3)), torch.randn(3, 40, 7, generator=_g(4))
    want = num.exact_matmul(a, b, engine="int64")
    assert torch.equal(num.exact_matmul(a.to(device), b.to(device), engine="triton").cpu(), want)
    for dtype in (torch.float16, torch.float32):
        x, w = torch.randn(9, 300, generator=_g(5)), torch.randn(300, 33, generator=_g(6))
        want = num.exact_matmul(x, w, dtype, engine="int8")
        assert torch.equal(num.exact_matmul(x.to(device), w.to(device), dtype, engine="triton").cpu(), want)


def test_bad_digits_are_one_line(device):
    d = torch.zeros(4, 1, 2, 8, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match=r"^digits: expected int8, got torch.int32 and torch.int8$"):
        digit_product(d.int(), d[0], 7)
    with pytest.raises(ValueError, match=r"^digits: b \(1, 6, 8\) does not match a \(4, 1, 2, 8\)"):
        digit_product(d, torch.zeros(1, 6, 8, dtype=torch.int8, device=device), 7)
    big = torch.zeros(4, 1, 1, 131072, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match=r"^K: 131072 x 4 digit pairs of 7 bits could overflow"):
        digit_product(big, big[:, 0].reshape(1, 4, -1), 7)


def test_a_cuda_device_takes_the_triton_engine_unless_one_is_chosen(monkeypatch):
    monkeypatch.setattr(gemm, "CHOSEN", False)
    assert gemm.engine_for(torch.device("cuda", 0)) == "triton"
    assert gemm.engine_for(torch.device("cpu")) == gemm.ENGINE
    monkeypatch.setattr(gemm, "CHOSEN", True)
    monkeypatch.setattr(gemm, "ENGINE", "fp64")
    assert gemm.engine_for(torch.device("cuda", 0)) == "fp64"
