"""The integer products of the layout-invariant mode (backends/invariant/gemm.py, SPEC 12): int8 digits that
rebuild the grid, the three exact GEMMs (int8 digit products, fp64, plain int64) giving the same integers
at GLM-5's widths and at the grid's extremes, the one rounding done in integers, and the error against
the exact product inside the tolerance the normal mode's conformance uses for each op."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from backends.invariant import engine as num
from backends.invariant import gemm
from conformance.comparators import COMPARATORS
from conformance.compare import Context


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_four_int8_digits_rebuild_every_grid_value():
    t = gemm.T_MAX
    q = torch.randint(-(2**t), 2**t + 1, (50_000,), generator=_g(0), dtype=torch.int32)
    q[:4] = torch.tensor([2**t, -(2**t), 2**t - 1, 0])
    d = gemm.digits(q)
    assert d.dtype == torch.int8 and d.shape == (4, 50_000)
    assert int(d.abs().max()) <= 64  # so every digit product is <= 2^12
    rebuilt = sum(d[i].int() << (7 * (3 - i)) for i in range(4))
    assert torch.equal(rebuilt, q)


@pytest.mark.parametrize(
    "m,k,n",
    [(9, 96, 7), (1, 1, 1), (3, 13, 5), (0, 5, 3), (4, 2048, 6), (2, 6144, 3), (2, 16384, 3)],
)
def test_the_three_integer_gemms_are_the_same_integers(m, k, n):
    t = gemm.grid_bits(k)
    a = torch.randint(-(2**t), 2**t + 1, (m, k), generator=_g(k), dtype=torch.int32)
    b = torch.randint(-(2**t), 2**t + 1, (k, n), generator=_g(k + 1), dtype=torch.int32)
    if m:  # a row and a column at the grid's extreme: |P| reaches K 2^(2t)
        a[0], b[:, 0] = 2**t, -(2**t)
    want = gemm.int_product(a, gemm.b_form(b, "int64"), "int64", t)
    for engine in ("int8", "fp64"):
        assert torch.equal(gemm.int_product(a, gemm.b_form(b, engine), engine, t), want), engine
    if m:
        assert int(want[0, 0]) == -k * 4**t  # the bound SPEC 12 states, reached and exact


def test_batched_products_and_every_engine_give_the_same_bits():
    a, b = torch.randn(2, 3, 5, 40, generator=_g(3)), torch.randn(3, 40, 7, generator=_g(4))
    want = num.exact_matmul(a, b, engine="int64")
    for engine in ("int8", "fp64"):
        assert torch.equal(num.exact_matmul(a, b, engine=engine), want)
    assert torch.equal(num.exact_matmul(a[1, 2], b[2], engine="int8"), want[1, 2])


def _rounded(p: int, n: int, dtype: torch.dtype) -> float:
    """p 2^n rounded to nearest even to dtype, in exact rationals (the subnormal ulp below the range)."""
    bits, emin = gemm._FORMAT[dtype]
    v = Fraction(p) * Fraction(2) ** n
    if v == 0:
        return 0.0
    e = abs(v.numerator).bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > abs(v):
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(v):
        e += 1
    ulp = max(e, emin) - bits + 1
    q = abs(v) / Fraction(2) ** ulp
    whole, rest = divmod(q.numerator, q.denominator)
    if 2 * rest > q.denominator or (2 * rest == q.denominator and whole % 2):
        whole += 1
    out = float(Fraction(whole) * Fraction(2) ** ulp) if ulp + bits < 1030 else float("inf")
    return -out if v < 0 else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_one_rounding_in_integers_is_round_to_nearest_even(dtype):
    rng = random.Random(0)
    ps, ns = [], []
    for i in range(1500):
        bits = rng.randint(0, 62)
        p = rng.randint(-(2**bits), 2**bits)
        if i % 5 == 0:  # an exact tie at the dtype's last place
            p = (2 * rng.randint(1, 2**20) + 1) << rng.randint(0, 30)
        ps.append(p)
        ns.append(rng.randint(-230, 120) if i % 2 else rng.randint(-60, -20))
    got = gemm.round_scaled(torch.tensor(ps), torch.tensor(ns), dtype)
    want = torch.tensor([_rounded(p, n, dtype) for p, n in zip(ps, ns, strict=True)], dtype=torch.float64)
    assert torch.equal(got, want.to(dtype))  # every value of `want` is exact in dtype (or inf)


#: (what, M, K, N, a, b, the normal mode's comparator for that op): GLM-5's K
_WIDTHS = [
    ("a linear of the hidden size", 16, 6144, 384, 1.0, 0.02, "default"),
    ("the dense MLP's down_proj", 8, 16384, 64, 0.1, 0.02, "default"),
    ("an expert's down_proj (grouped_matmul)", 16, 2048, 256, 0.1, 0.02, "grouped"),
    ("attention q . k (512 + 64)", 16, 576, 512, 0.1, 1.0, "attention"),
    ("attention p . v (2048 selected keys)", 16, 2048, 128, None, 1.0, "attention"),
    ("the indexer's q . k", 16, 128, 512, 1.0, 1.0, "indexer_logits"),
]


@pytest.mark.parametrize("what,m,k,n,sa,sb,comparator", _WIDTHS, ids=[w[0] for w in _WIDTHS])
def test_the_error_at_glm5_widths_is_inside_the_normal_modes_tolerance(what, m, k, n, sa, sb, comparator):
    g = _g(k + n)
    a = (
        torch.softmax(3 * torch.randn(m, k, generator=g), -1)
        if sa is None
        else sa * torch.randn(m, k, generator=g)
    )
    b = sb * torch.randn(k, n, generator=g)
    exact = (a.double() @ b.double()).float()
    got = num.exact_matmul(a, b)
    check = COMPARATORS[comparator]("out", got, exact, Context(op=what, dtype="float32", args={}))
    assert check.ok, check.message
    # and no worse than an fp32 GEMM by more than the grid's own rounding
    fp32 = (a @ b).double() - exact.double()
    assert (got.double() - exact.double()).abs().max() <= 2 * fp32.abs().max() + 2.0**-20 * exact.abs().max()


def test_a_bad_gemm_choice_is_one_line(monkeypatch):
    monkeypatch.setenv(gemm.GEMM_ENV, "fp16")
    expected = r"^GLM5_INVARIANT_GEMM: expected one of int8, fp64, int64, triton, ascend, got 'fp16'$"
    with pytest.raises(ValueError, match=expected):
        gemm._engine()
    monkeypatch.setenv(gemm.GEMM_ENV, "int8")
    assert gemm._engine() == "int8"


@pytest.mark.parametrize("shift", [14, 21])
def test_the_rounding_to_odd_of_two_fp64_parts_gives_the_integer_roundings_bits(shift):
    """The fp64 engine (P = (h b) 2^14 + l b) and the int8 engine (P = hi 2^21 + lo from its level sums)
    round their two exact parts to odd in fp64 and cast once; at ties, near-ties and signed zeros that is
    `round_scaled` of the integer P."""
    rng = random.Random(1)
    ps = [rng.randint(-(2**62), 2**62) >> rng.randint(0, 60) for _ in range(3000)]
    ps += [(2 * rng.randint(2**23, 2**24) + 1) << rng.randint(0, 36) for _ in range(1000)]  # exact ties
    ps += [((2 * rng.randint(2**23, 2**24) + 1) << 30) + rng.choice([-1, 1]) for _ in range(1000)]
    ps += [0, 1, -1, 2**62, -(2**62)]
    p = torch.tensor(ps)
    half = 1 << (shift - 1)
    low = ((p + half) & (2 * half - 1)) - half
    ph, pl = ((p - low) >> shift).double(), low.double()  # both exact
    n_row = torch.randint(-200, 20, (p.shape[0],), generator=_g(5))  # subnormal and zero results too
    zeros = torch.zeros(1, dtype=torch.int64)
    got = gemm._round_odd_fp32(ph[:, None], pl[:, None], n_row, zeros, shift)[:, 0]
    want = gemm.round_scaled(p, n_row, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    zero = torch.tensor([[-0.0]], dtype=torch.float64)  # an fp64 GEMM's sum of -0 products
    assert gemm._round_odd_fp32(zero, zero, zeros, n_row[:1], shift).view(torch.int32) == 0


def _midpoint_operands() -> tuple[torch.Tensor, torch.Tensor]:
    """a [1, 3], b [3, 1] whose grids (t = 27, e = f = 0) give P = 2^54 - 2^32 + 2^29 + 1: an fp32 midpoint
    plus one, which every fp64 summation order rounds to the midpoint itself (ulp 4 there)."""
    a = torch.tensor([[1 - 2.0**-23, 2.0**-19, 2.0**-27]])
    b = torch.tensor([[1 - 2.0**-23], [(2**21 - 1) * 2.0**-27], [2.0**-27]])
    return a, b


def test_the_certified_fp64_gemm_falls_back_where_its_bound_cannot_decide():
    """One fp64 GEMM rounds to fp32 wrongly at this midpoint (ties to even instead of up): the certificate
    must send the element to the exact integer product. Alone, and among random elements, in a broadcast
    batch, and as a whole matrix of them (the two-GEMM form)."""
    a, b = _midpoint_operands()
    assert gemm.grid_bits(3) == 27
    plain = (a.double() @ b.double()).float()  # the grid is a, b themselves (times 2^27): v = the midpoint
    want = num.exact_matmul(a, b, engine="int64")
    assert not torch.equal(plain, want)
    assert torch.equal(num.exact_matmul(a, b, engine="fp64"), want)
    rand_a, rand_b = torch.randn(2, 3, 5, 3, generator=_g(6)), torch.randn(3, 3, 4, generator=_g(7))
    rand_a[1, 2, 0], rand_b[2, :, 3] = a[0], b[:, 0]
    want = num.exact_matmul(rand_a, rand_b, engine="int64")
    assert torch.equal(
        num.exact_matmul(rand_a, rand_b, engine="fp64").view(torch.int32), want.view(torch.int32)
    )
    many_a, many_b = a.expand(40, 3), b.expand(3, 30)
    assert torch.equal(
        num.exact_matmul(many_a, many_b, engine="fp64"), num.exact_matmul(many_a, many_b, engine="int64")
    )


@pytest.mark.parametrize("k", [1, 64, 576, 2048, 4096])
def test_the_certified_fp64_gemm_gives_the_integer_products_bits(k):
    """fp32 results of the fp64 engine (one GEMM, certified) against the int64 engine: random, integer
    (cancellations to exact zeros), tiny (subnormal results), bf16 and zero rows / columns."""
    g = _g(k)
    a, b = torch.randn(33, k, generator=g), torch.randn(k, 17, generator=g)
    cases = [(a, b), (a.round(), b.round()), (a * 1e-25, b * 1e-18), (a.bfloat16(), b)]
    zero_a, zero_b = a.clone(), b.clone()
    zero_a[3], zero_b[:, 5] = 0, 0
    cases.append((zero_a, zero_b))
    for x, y in cases:
        want = num.exact_matmul(x, y, torch.float32, engine="int64")
        got = num.exact_matmul(x, y, torch.float32, engine="fp64")
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_certificate_uses_the_narrower_half_gap_below_a_power_of_two():
    """v just above r = 1 with a bound of 0.75 fp32 half-ulps: X may lie below 1 - 2^-25, the midpoint
    under 1 (the gap below a power of two is half), and round to 1 - 2^-24, so it is undecided; the same
    bound around 1.5, or 0.45 of it around 1, decides."""
    from backends.invariant import certified

    v = torch.tensor([1 + 2.0**-40, 1.5 + 2.0**-40, 1 + 2.0**-40, 0.0, 2.0**-140], dtype=torch.float64)
    bound = torch.tensor([0.75, 0.75, 0.45, 0.0, 0.0], dtype=torch.float64)
    got = certified.undecided(v, v.float(), bound, torch.ones(5, dtype=torch.float64))
    assert got.tolist() == [True, False, False, True, True]  # zero and subnormal r never pass


@pytest.mark.parametrize("k", [1, 13, 576, 6144, 16384])
def test_the_int8_engines_fp32_results_are_the_integer_products_bits(k):
    """fp32 results of the int8 engine (seven level sums by torch._int_mm, P = hi 2^21 + lo in fp64, rounded
    to odd and cast once) against the int64 engine: random, integer, tiny (subnormal results), a row and a
    column at the grid's extreme, and the fp32 midpoint that any fp64 summation rounds the wrong way."""
    g = _g(k)
    a, b = torch.randn(9, k, generator=g), torch.randn(k, 6, generator=g)
    extreme_a, extreme_b = a.clone(), b.clone()
    extreme_a[0], extreme_b[:, 0] = 1.0, -1.0  # every grid value 2^t: |P| = K 2^(2t)
    cases = [(a, b), (a.round(), b.round()), (a * 1e-25, b * 1e-18), (extreme_a, extreme_b)]
    for x, y in cases:
        want = num.exact_matmul(x, y, torch.float32, engine="int64")
        got = num.exact_matmul(x, y, torch.float32, engine="int8")
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    a, b = _midpoint_operands()
    assert torch.equal(num.exact_matmul(a, b, engine="int8"), num.exact_matmul(a, b, engine="int64"))


def test_a_cpu_product_takes_int8_above_the_one_gemm_forms_k_where_the_cpu_has_int8_dot_products(monkeypatch):
    monkeypatch.setattr(gemm, "CHOSEN", False)
    cpu = torch.device("cpu")
    for int8_dot in (True, False):
        monkeypatch.setattr(gemm, "INT8_DOT", int8_dot)
        assert gemm.engine_for(cpu, gemm.ONE_GEMM_K_MAX) == "fp64"
        assert gemm.engine_for(cpu, gemm.ONE_GEMM_K_MAX + 1) == ("int8" if int8_dot else "fp64")
        assert gemm.engine_for(cpu, 6144, batched=True) == "fp64"  # torch._int_mm is 2-D only
