"""The arithmetic of the layout-invariant mode (SPEC 12): results that follow from the inputs by
construction, whatever the summation order a BLAS, a thread split, a batch size or a tensor-parallel
split would pick.

- `exact_matmul`: inputs rounded once to a t-bit fixed-point grid per row of A / column of B, the
  integer product P computed exactly (by int8 digit products with int32 accumulation, by fp64 GEMMs of
  exact integer partial sums, or a plain int64 matmul; on a CUDA device by a Triton kernel's int8
  `tl.dot`: the same integers, so `engine_for` picks per product by speed), so any order of the K loop,
  any split of K over ranks and any integer GEMM give the same bits; scaled and rounded once at the end.
  fp32 results on the fp64 engine (K <= 4096) come from one fp64 GEMM whose rounding an any-order error
  bound certifies per element, P formed exactly only where it cannot (certified.py): the same bits.
- `tree_sum`: a fixed binary tree of adds over one dimension (zero-padded to a power of two).
- `exp`, `log`, `sigmoid`, `silu`: fixed formulas of IEEE basic ops in fp32 (bf16 / fp16 through fp32;
  fp64 input in fp64), `sin`, `cos` in fp64 (RoPE's table, which the model builds in fp64), so an
  element's bits do not depend on where a vectorised kernel's SIMD body or tail puts it.

`active()` says whether the mode is on; it is process-wide (the cpu backend runs blocks on Python
threads) and is turned on by `glm5.parallel.invariant.layout_invariant()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from backends.invariant import certified, gemm
from backends.invariant.gemm import (  # noqa: F401  (grid_bits ... scaled: this module's public names too)
    ENGINE,
    b_form,
    engine_for,
    grid_bits,
    grid_product,
    ldexp,
    pow2,
    pow2_32,
    rounded_product,
    scale_exponent,
    scaled,
    to_grid,
)

_lock = threading.Lock()
_depth = 0


class NotLayoutInvariant(ValueError):
    """What the layout-invariant mode cannot run: a backend op that does not declare it, a split it has no
    exact product for, a fused loss it does not cover."""


def active() -> bool:
    """Whether the layout-invariant mode is on (in any thread of the process)."""
    return _depth > 0


@contextlib.contextmanager
def switched_on() -> Iterator[None]:
    """The flag alone (backends read it); `glm5.parallel.invariant.layout_invariant` is the switch."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


# -- a row-parallel layer's split: an argument of its product ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class RowSplit:
    """A row-parallel layer's K split over `group` (rank, size, all_reduce, all_gather): the product takes
    its row and column maxima over the group and sums its integer partials over it (SPEC 12). k_total is
    the unsplit K (it sets the grid)."""

    group: object
    k_total: int

    def max_over(self, m: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(m[None], 0).amax(0)

    def sum_over(self, p: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(p)  # int64: exact in any order, any communicator


class _Grid:
    """A weight's column side of `exact_matmul` (exponents f and the integer grid in an engine's form)
    and the values it was made from. A hit compares the values (one read, a third of making the grid):
    version counters cannot be trusted here (FSDP2 gathers new weights into the same storage under the
    old version; the cpu backend's ops get aliases with counters of their own; `.data` writes bypass
    them)."""

    __slots__ = ("storage", "values", "f", "form")

    def __init__(self, storage: StorageWeakRef, values: torch.Tensor, f: torch.Tensor, form: torch.Tensor):
        self.storage, self.values, self.f, self.form = storage, values, f, form


#: (storage address, view geometry, t, engine) -> _Grid; entries of freed storages are swept as it grows
_grids: dict[tuple, _Grid] = {}
_sweep_at = 256


def _remember(key: tuple, entry: _Grid) -> None:
    global _sweep_at
    if len(_grids) >= _sweep_at:
        for k in [k for k, g in _grids.items() if g.storage.expired()]:
            del _grids[k]
        _sweep_at = max(256, 2 * len(_grids))
    _grids[key] = entry


def _is_parameter(x) -> bool:
    # isinstance(x, nn.Parameter) runs a Python metaclass hook: a measurable cost at this call count
    return type(x) is torch.nn.Parameter or (
        type(x) is not torch.Tensor and isinstance(x, torch.nn.Parameter)
    )


def _col_max(b: torch.Tensor) -> torch.Tensor:
    return b.abs().amax(-2) if b.shape[-2] else b.new_zeros(b.shape[:-2] + b.shape[-1:])


def _column_side(b: torch.Tensor, t: int, weight: bool, engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, b's grid in the engine's form) of b [..., K, N]; cached when b is a CPU weight (a view of a
    Parameter, or the caller says so: activations would only fill memory), served while b holds the same
    values. A device's weights are not cached: comparing the values would read a flag back to the host on
    every product, where making the grid is a few elementwise passes on the device."""
    cacheable = b.device.type == "cpu" and (weight or _is_parameter(b._base if b._is_view() else b))
    if cacheable:
        key = (
            b.untyped_storage().data_ptr(),
            b.storage_offset(),
            tuple(b.shape),
            b.stride(),
            b.dtype,
            t,
            engine,
        )
        entry = _grids.get(key)
        if entry is not None and not entry.storage.expired() and torch.equal(entry.values, b):
            return entry.f, entry.form
    f = scale_exponent(_col_max(b))
    b_q = to_grid(b, f[..., None, :], t)
    form = certified.b_form(b_q, f, t) if engine == certified.FORM else b_form(b_q, engine)
    if cacheable:
        _remember(key, _Grid(StorageWeakRef(b.untyped_storage()), b.clone(), f, form))
    return f, form


def exact_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    split: RowSplit | None = None,
    k_total: int | None = None,
    max_over: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sum_over: Callable[[torch.Tensor], torch.Tensor] | None = None,
    weight: bool = False,
    engine: str | None = None,
) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> [..., M, N] in out_dtype (default a's), the same bits for any
    blocking, batch, row subset, split of K or integer GEMM (`engine`, default `engine_for`'s choice for
    the device, K and whether the product is batched).

    Row-parallel use (K split over ranks): `split` (or its parts: k_total the unsplit K, max_over the
    elementwise max over the ranks of the per-row and per-column maxima, sum_over the sum over the ranks
    of the int64 partial products, exact in any order); every rank then returns the unsplit product's
    bits. b's side is cached (`_column_side`) when b is a weight (`weight`, or a view of a Parameter),
    outside the row-parallel case.
    """
    if split is not None:
        k_total, max_over, sum_over = split.k_total, split.max_over, split.sum_over
    batched = max(a.dim(), b.dim()) > 2
    engine = engine or engine_for(a.device, k_total or a.shape[-1], batched)
    dtype = out_dtype or a.dtype
    t = grid_bits(k_total or a.shape[-1])
    row_max = a.abs().amax(-1) if a.shape[-1] else a.new_zeros(a.shape[:-1])
    if max_over is None:
        e = scale_exponent(row_max)
        if sum_over is None and certified.applies(a, b, dtype, t, engine):  # one fp64 GEMM, certified
            f, b_side = _column_side(b, t, weight, certified.FORM)
            return certified.rounded_fp32(a, e, t, b_side, f)
        f, b_side = _column_side(b, t, weight, engine)
    else:
        e, f = scale_exponent(max_over(row_max.float())), scale_exponent(max_over(_col_max(b).float()))
        b_side = b_form(to_grid(b, f[..., None, :], t), engine)
    if sum_over is None:
        return rounded_product(a, e, t, b_side, f, engine, dtype)
    return scaled(sum_over(grid_product(a, e[..., None], t, b_side, engine)), e, f, t, dtype)


def exact_grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, out_dtype: torch.dtype, engine: str
) -> torch.Tensor:
    """The float grouped_matmul in the mode (SPEC 12): out[rows of e] = exact(x[rows of e], w[e]^T) in
    out_dtype, one exact product per non-empty expert (a row's grid is its own, so neither the expert's
    other rows nor the row count enters), rows of no expert 0. One host read of the offsets, as the
    reference's loop over experts."""
    out = torch.zeros((x.shape[0], w.shape[1]), dtype=out_dtype, device=x.device)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        if offs[e] < offs[e + 1]:
            r = slice(offs[e], offs[e + 1])
            out[r] = exact_matmul(x[r], w[e].T, out_dtype, weight=True, engine=engine)
    return out


def int8_product(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] @ w int8 [N, K]^T exactly, as int32 (|acc| <= 127^2 K < 2^31 for K < 133,000; the
    W8A8 / W4A8 linears of the mode): int8 x int8 -> int32 by torch._int_mm on a CPU with int8 dot
    products, else one fp64 GEMM (every partial sum an integer below 2^53): the same integers."""
    if xq.device.type == "cpu" and gemm.INT8_DOT:
        return gemm.int8_mm(xq, w)
    return (xq.double() @ w.double().T).to(torch.int32)


# -- the fixed reduction tree ----------------------------------------------------------------------------
def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` by a fixed tree: zero-pad to P = 2^ceil(log2 n), then add adjacent pairs
    (x[2i] + x[2i+1]) level by level. An aligned block of 2^j elements is a subtree of it."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = torch.cat([x, x.new_zeros(x.shape[:-1] + (p - n,))], -1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    out = x[..., 0] if n else x.new_zeros(x.shape[:-1])
    return out.unsqueeze(-1).movedim(-1, dim) if keepdim else out


def weighted_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w [T, H], x [T, H, S] (fp32 or narrower) -> fp32 [T, S]: sum_h w[t, h] x[t, h, s], each product one
    fp32 multiply, summed over h by the fixed tree in fp32. The indexer's head-weighted sum: H is never
    split (the indexer is replicated), so a fixed order is enough; no exact form is needed."""
    return tree_sum(x.float() * w.float()[:, :, None], 1)


# -- transcendentals: fixed formulas of IEEE basic operations in the input's own type --------------------
# fp32 (bf16 / fp16 computed in fp32, rounded once to their type): Cody-Waite reduction with a 16-bit
# ln2 head, so n ln2_hi is exact for |n| <= 2^8; fp64 (RoPE's table, which the model builds in fp64):
# the same formulas with fdlibm's constants and more terms.
LN2_HI_32 = 0.693145751953125  # 16 significant bits
LN2_LO_32 = 1.428606765330187045e-06
INV_LN2_32 = 1.4426950216293335
SQRT_HALF = 0.7071067811865476
LN2_HI = 6.93147180369123816490e-01  # fdlibm: n * LN2_HI is exact for |n| < 2^11
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
_EXP_TERMS = 14  # Taylor terms of exp(r), |r| <= ln2 / 2: truncation below 1e-17 relative
_ATANH_TERMS = 13  # odd terms of atanh(s), |s| <= 0.1716


def _exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x of fp32 x: clamp to [-104, 89] (0 and inf beyond); n = round(x / ln2); r = (x - n ln2_hi) -
    n ln2_lo; e^r = 1 + (r + r^2 q(r)), q the Taylor terms 1/2! ... 1/8! by Horner; times 2^h 2^(n - h),
    h = floor(n / 2) (the first step stays normal, so a subnormal result is rounded once)."""
    xc = x.clamp(-104.0, 89.0)
    n = (xc * INV_LN2_32).round_()
    r = (xc - n * LN2_HI_32) - n * LN2_LO_32
    q = torch.full_like(r, 1.0 / math.factorial(8))
    for i in range(7, 1, -1):
        q = q * r + 1.0 / math.factorial(i)
    p = (r * r * q + r) + 1.0
    ni = n.to(torch.int32)
    h = torch.div(ni, 2, rounding_mode="floor")
    return torch.where(torch.isnan(x), x, p * pow2_32(h) * pow2_32(ni - h))


def _log32(x: torch.Tensor) -> torch.Tensor:
    """ln x of fp32 x: x = m 2^e, m in [sqrt(1/2), sqrt(2)); f = m - 1, s = f / (2 + f); ln m = 2s +
    2s s^2 p(s^2), p the odd atanh terms 1/3 ... 1/13 by Horner; ln x = e ln2_hi + (e ln2_lo + ln m)."""
    m, e = torch.frexp(x)
    small = m < SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).float()
    f = m - 1.0
    s = f / (2.0 + f)
    s2 = s * s
    p = torch.full_like(s, 1.0 / 13)
    for i in range(5, 0, -1):
        p = p * s2 + 1.0 / (2 * i + 1)
    y = e * LN2_HI_32 + (e * LN2_LO_32 + (2.0 * s * s2 * p + 2.0 * s))
    y = torch.where(x == 0, -math.inf, y)
    y = torch.where(torch.isposinf(x), math.inf, y)
    return torch.where((x < 0) | torch.isnan(x), math.nan, y)


def _exp64(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp64 (x clamped to [-1100, 710])."""
    x = x.clamp(-1100.0, 710.0)
    n = torch.round(x * INV_LN2)
    r = (x - n * LN2_HI).sub_(n * LN2_LO)
    p = torch.full_like(r, 1.0 / math.factorial(_EXP_TERMS - 1))
    for i in range(_EXP_TERMS - 2, -1, -1):
        p.mul_(r).add_(1.0 / math.factorial(i))
    return ldexp(p, n)


def _exp_any(x: torch.Tensor) -> torch.Tensor:
    """e^x in x's working type: fp64 for fp64, else fp32."""
    return torch.where(torch.isnan(x), x, _exp64(x)) if x.dtype == torch.float64 else _exp32(x.float())


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, NaN kept."""
    return _exp_any(x).to(x.dtype)


def _log64(x: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(x)  # x = m 2^e, m in [0.5, 1)
    small = m < SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).double()
    f = m - 1.0
    s = f / (2.0 + f)
    s2 = s * s
    p = torch.full_like(s, 1.0 / (2 * _ATANH_TERMS - 1))
    for i in range(_ATANH_TERMS - 2, -1, -1):
        p = p * s2 + 1.0 / (2 * i + 1)
    y = e * LN2_HI + (e * LN2_LO + 2.0 * s * p)
    y = torch.where(x == 0, -math.inf, y)
    y = torch.where(torch.isposinf(x), math.inf, y)
    return torch.where((x < 0) | torch.isnan(x), math.nan, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log (-inf at 0, NaN below)."""
    return (_log64(x) if x.dtype == torch.float64 else _log32(x.float())).to(x.dtype)


PIO2_1 = 1.57079632673412561417e00  # fdlibm's pi/2 in three parts (n * PIO2_1, n * PIO2_2 exact)
PIO2_2 = 6.07710050650619224932e-11
PIO2_3 = 2.02226624879595063154e-21
INV_PIO2 = 6.36619772367581382433e-01
_TRIG_TERMS = 12


def _sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) for |x| up to about 2^30 (RoPE angles)."""
    n = torch.round(x * INV_PIO2)
    r = ((x - n * PIO2_1) - n * PIO2_2) - n * PIO2_3  # |r| <= pi/4
    r2 = r * r
    s = torch.full_like(r, (-1) ** (_TRIG_TERMS - 1) / math.factorial(2 * _TRIG_TERMS - 1))
    c = torch.full_like(r, (-1) ** (_TRIG_TERMS - 1) / math.factorial(2 * _TRIG_TERMS - 2))
    for i in range(_TRIG_TERMS - 2, -1, -1):
        s = s * r2 + (-1) ** i / math.factorial(2 * i + 1)
        c = c * r2 + (-1) ** i / math.factorial(2 * i)
    s = s * r
    q = torch.remainder(n, 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def sin(x: torch.Tensor) -> torch.Tensor:
    return _sincos64(x.double())[0].to(x.dtype)


def cos(x: torch.Tensor) -> torch.Tensor:
    return _sincos64(x.double())[1].to(x.dtype)


# -- RoPE's cos / sin without fp64: the angle in exact integer turns ------------------------------------
TURN_BITS = 62  # an angle is a fraction of a turn in units of 2^-62
_PI_50 = "3.14159265358979323846264338327950288419716939937510"
_rope_turns: dict[tuple[int, float, str], torch.Tensor] = {}


def _turns_per_position(dim: int, theta: float) -> list[int]:
    """F_i = round(w_i / (2 pi) 2^62), w_i = theta^(-2i / dim), i < dim / 2: computed once on the host in
    50-digit decimal arithmetic (libmpdec: integer arithmetic, the same digits on every machine; its
    power is correctly rounded but for values within 1e-50 of a rounding boundary), rounded once."""
    import decimal

    ctx = decimal.Context(prec=50, rounding=decimal.ROUND_HALF_EVEN)
    two_pi = ctx.multiply(decimal.Decimal(2), decimal.Decimal(_PI_50))
    base = decimal.Decimal(repr(float(theta)))
    out = []
    for i in range(dim // 2):
        w = ctx.power(base, ctx.divide(decimal.Decimal(-2 * i), decimal.Decimal(dim)))
        out.append(
            int(ctx.multiply(ctx.divide(w, two_pi), decimal.Decimal(2**TURN_BITS)).to_integral_value())
        )
    return out


def _sin_cos_octant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin x, cos x for fp32 x in [0, pi/4]: Taylor to x^9 / 9! and x^10 / 10! by Horner in fp32 (the first
    terms left out are below 2^-27 there)."""
    x2 = x * x
    s = torch.full_like(x, 1.0 / math.factorial(9))
    for i in (7, 5, 3):
        s = s * x2 + (-1) ** ((i - 1) // 2) / math.factorial(i)
    c = torch.full_like(x, -1.0 / math.factorial(10))
    for i in (8, 6, 4, 2, 0):
        c = c * x2 + (-1) ** (i // 2) / math.factorial(i)
    return x + x * x2 * s, c


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim / 2] fp32 of the angles p w_i (SPEC 12 RoPE), with no fp64: the angle in turns,
    (p F_i) mod 2^62 (`_turns_per_position`), in exact int64 products (p < 2^24: F = Fh 2^31 + Fl, each
    product below 2^55); the quadrant from its top two bits; the rest folded to at most an eighth of a
    turn, turned into radians in fp32 from two exact 24-bit parts; sin and cos there by fixed Taylor
    polynomials; the quadrant's signs and swap. Within a few fp32 ulp of the true cos / sin."""
    key = (dim, float(theta), str(positions.device))
    f = _rope_turns.get(key)
    if f is None:
        f = torch.tensor(_turns_per_position(dim, theta), dtype=torch.int64).to(positions.device)
        _rope_turns[key] = f
    p = positions.to(torch.int64)[:, None]
    low31 = (1 << 31) - 1
    turns = (((p * (f >> 31)) & low31) << 31) + p * (f & low31)
    turns = turns & ((1 << TURN_BITS) - 1)
    quadrant = turns >> (TURN_BITS - 2)
    g = turns & ((1 << (TURN_BITS - 2)) - 1)  # the angle inside its quadrant, in 2^-62 turns
    half = 1 << (TURN_BITS - 3)
    upper = g > half  # past an eighth of a turn: the complement, sin and cos swapped
    g = torch.where(upper, 2 * half - g, g)  # <= 2^59
    # radians = g 2^-62 2 pi: g's top 24 bits and the next 24, each exactly an fp32
    scale = 2.0 * math.pi * 2.0**-TURN_BITS
    x = (g >> 35).float() * (scale * 2.0**35) + ((g >> 11) & ((1 << 24) - 1)).float() * (scale * 2.0**11)
    s, c = _sin_cos_octant(x)
    s, c = torch.where(upper, c, s), torch.where(upper, s, c)
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c, torch.where(quadrant == 2, -s, -c)))
    cos = torch.where(quadrant == 0, c, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c, s)))
    return cos, sin


def pow_scalar(base: float, x: torch.Tensor) -> torch.Tensor:
    """base ** x for a positive scalar base: exp(x ln(base)) by the formula (RoPE's inverse frequencies)."""
    w = x if x.dtype == torch.float64 else x.float()
    return exp(w * math.log(base)).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) in x's working type."""
    return (1.0 / (1.0 + _exp_any(-x))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + e^-x) in x's working type."""
    w = x if x.dtype == torch.float64 else x.float()
    return (w / (1.0 + _exp_any(-w))).to(x.dtype)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """max + log(tree_sum(exp(x - max))); -inf for an all -inf row (as torch)."""
    m = x.amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m).to(x.dtype)
    out = log(tree_sum(exp(x - m), dim, keepdim=True)) + m
    return out if keepdim else out.squeeze(dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    m = x.amax(dim, keepdim=True)
    e = exp(x - torch.where(torch.isinf(m), 0.0, m).to(x.dtype))
    return e / tree_sum(e, dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x - logsumexp(x, dim, keepdim=True)
