"""The layout-invariant mode's "ascend" engine (kernels_ascend/invariant_gemm.py, SPEC 12): the seven level
sums of int8 digit products by `tl.dot` with int32 accumulation, combined in int64 by torch ops, give the
int64 engine's integers bitwise. Every product and sum is an exact integer, so a bitwise check under
triton-ascend's interpreter tests the kernel's logic (tiles, masks, the pairs of each level, the batch
loop) the way an NPU runs it; the cube's int8 MMA itself is the compiler's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from backends.invariant import engine as num
from backends.invariant import gemm
from kernels_ascend import LAUNCHES
from kernels_ascend.invariant_gemm import level_sums


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 1, 1),
        (3, 13, 5),  # K below one block
        (17, 300, 70),  # M and N over one interpreter tile in N, K not a multiple of the block
        (70, 33, 130),  # over one tile in M and N
        (2, 2048, 3),  # GLM-5's K: selected keys, an expert's intermediate
        (2, 6144, 3),  # the hidden size
        (2, 16384, 3),  # the dense intermediate
    ],
)
def test_the_kernel_gives_the_int64_engines_integers(m, k, n):
    t = gemm.grid_bits(k)
    a = torch.randint(-(2**t), 2**t + 1, (m, k), generator=_g(k), dtype=torch.int32)
    b = torch.randint(-(2**t), 2**t + 1, (k, n), generator=_g(k + 1), dtype=torch.int32)
    a[0], b[:, 0] = 2**t, -(2**t)  # |P| reaches K 2^(2t), SPEC 12's bound
    if m > 1:
        a[1], b[:, -1] = -(2**t), -(2**t)
    want = gemm.int_product(a, gemm.b_form(b, "int64"), "int64", t)
    before = LAUNCHES["invariant_gemm"]
    got = gemm.int_product(a, gemm.b_form(b, "ascend"), "ascend", t)
    assert LAUNCHES["invariant_gemm"] == before + 1
    assert torch.equal(got, want)
    assert int(got[0, 0]) == -k * 4**t


def test_worst_case_digits_at_k_16384_sum_exactly_in_int32():
    """Digits of magnitude 64 and 63, every digit of a row (column) the same: the middle level sums its 4
    pairs over K = 16,384 to an odd integer just under 2^28 that fp32 cannot hold, so an fp32 (or any
    inexact) accumulation in the interpreter's NumPy matmul or on the cube fails this."""
    k, n = 16384, 2
    ks = torch.arange(k)
    a = torch.where(ks % 3 == 0, -63, -64).to(torch.int8).expand(4, 1, 2, k).clone()
    a[:, :, 1] = -a[:, :, 1]
    b = torch.where(ks % 5 == 0, -63, -64).to(torch.int8).expand(1, 4, n, k).clone()
    got = level_sums(a, b, 7)
    assert got.dtype == torch.int32 and got.shape == (1, 7, 2, n)
    for r in range(2):
        dot = sum(x * y for x, y in zip(a[0, 0, r].tolist(), b[0, 0, 0].tolist(), strict=True))
        pairs = [1, 2, 3, 4, 3, 2, 1]  # the digit pairs (i, j) of each level i + j
        assert [int(got[0, level, r, 0]) for level in range(7)] == [p * dot for p in pairs]
    middle = int(got[0, 3, 0, 0])
    assert 2**27 < middle < 2**28 and float(torch.tensor(middle, dtype=torch.float32)) != middle


def test_exact_matmul_on_the_ascend_engine_has_every_engines_bits():
    a, b = torch.randn(2, 3, 5, 40, generator=_g(3)), torch.randn(3, 40, 7, generator=_g(4))
    before = LAUNCHES["invariant_gemm"]
    want = num.exact_matmul(a, b, engine="int64")
    assert torch.equal(num.exact_matmul(a, b, engine="ascend"), want)
    assert LAUNCHES["invariant_gemm"] == before + 1  # every batch entry in one launch
    x, w = torch.randn(9, 300, generator=_g(5)), torch.randn(300, 33, generator=_g(6))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = num.exact_matmul(x, w, dtype, engine="int64")
        assert torch.equal(num.exact_matmul(x, w, dtype, engine="ascend"), want)
    assert not torch.equal(num.exact_matmul(x, w, engine="ascend"), x @ w)  # the normal GEMM differs


def test_bad_digits_are_one_line():
    d = torch.zeros(4, 1, 2, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^digits: expected int8, got torch.int32 and torch.int8$"):
        level_sums(d.int(), d[:, 0, None].transpose(0, 1), 7)
    with pytest.raises(ValueError, match=r"^digits: b \(1, 4, 2, 9\) does not match a"):
        level_sums(d, torch.zeros(1, 4, 2, 9, dtype=torch.int8), 7)
    big = torch.zeros(4, 1, 1, 131072, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^K: 131072 x 4 digit pairs of 7 bits could overflow"):
        level_sums(big, big.transpose(0, 1), 7)


class _Dtypes(TorchDispatchMode):
    """Every dtype an op's inputs or outputs take."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in (*pytree.tree_leaves((args, kwargs)), *pytree.tree_leaves(out)):
            if isinstance(x, torch.Tensor):
                self.seen.add(x.dtype)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ascend_engine_takes_no_fp64_step(dtype):
    """The NPU's cube has no fp64: grid, digits, level sums, the int64 combination and the one rounding
    (`round_scaled`) run in int8 / int32 / int64 / fp32 (the fp64 engine, for contrast, does not)."""
    a, b = torch.randn(5, 300, generator=_g(7)).to(dtype), torch.randn(300, 9, generator=_g(8)).to(dtype)
    for engine, fp64 in (("ascend", False), ("fp64", True)):
        with _Dtypes() as mode:
            num.exact_matmul(a, b, engine=engine)
        assert (torch.float64 in mode.seen) == fp64, engine


def test_an_npu_takes_the_ascend_engine_unless_one_is_chosen(monkeypatch):
    npu = SimpleNamespace(type="npu")  # torch knows the device type only once torch_npu registers it
    monkeypatch.setattr(gemm, "CHOSEN", False)
    assert gemm.engine_for(npu) == "ascend"
    assert gemm.engine_for(npu, 16384, batched=True) == "ascend"
    monkeypatch.setattr(gemm, "CHOSEN", True)
    monkeypatch.setattr(gemm, "ENGINE", "fp64")
    assert gemm.engine_for(npu) == "fp64"
