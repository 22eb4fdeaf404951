"""The arithmetic of the layout-invariant mode (SPEC 12): results that follow from the inputs by
construction, whatever the summation order a BLAS, a thread split, a batch size or a tensor-parallel
split would pick.

- `exact_matmul`: inputs rounded once to a t-bit fixed-point grid per row of A / column of B, the
  integer product P computed exactly (int64; by int8 digit products with int32 accumulation, by fp64
  GEMMs of exact integer partial sums, or a plain int64 matmul: `ENGINE`, the same integers), so any
  order of the K loop, any split of K over ranks and any integer GEMM give the same bits; scaled and
  rounded once at the end, in integer operations.
- `tree_sum`: a fixed binary tree of adds over one dimension (zero-padded to a power of two).
- `exp`, `log`, `sin`, `cos`: fixed formulas of IEEE basic ops (in fp64, rounded once to the input's
  dtype), so an element's bits do not depend on where a vectorised kernel's SIMD body or tail puts it.

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

from backends.invariant_gemm import (  # noqa: F401  (grid_bits ... scaled: this module's public names too)
    ENGINE,
    b_form,
    grid_bits,
    grid_product,
    ldexp,
    pow2,
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
    """(f, b's grid in the engine's form) of b [..., K, N]; cached when b is a weight (a view of a
    Parameter, or the caller says so: activations would only fill memory), served while b holds the same
    values."""
    cacheable = weight or _is_parameter(b._base if b._is_view() else b)
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
    form = b_form(to_grid(b, f[..., None, :], t), engine)
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
    blocking, batch, row subset, split of K or integer GEMM (`engine`, default ENGINE).

    Row-parallel use (K split over ranks): `split` (or its parts: k_total the unsplit K, max_over the
    elementwise max over the ranks of the per-row and per-column maxima, sum_over the sum over the ranks
    of the int64 partial products, exact in any order); every rank then returns the unsplit product's
    bits. b's side is cached (`_column_side`) when b is a weight (`weight`, or a view of a Parameter),
    outside the row-parallel case.
    """
    if split is not None:
        k_total, max_over, sum_over = split.k_total, split.max_over, split.sum_over
    engine = engine or ENGINE
    dtype = out_dtype or a.dtype
    t = grid_bits(k_total or a.shape[-1])
    row_max = a.abs().amax(-1) if a.shape[-1] else a.new_zeros(a.shape[:-1])
    if max_over is None:
        e = scale_exponent(row_max)
        f, b_side = _column_side(b, t, weight, engine)
    else:
        e, f = scale_exponent(max_over(row_max.float())), scale_exponent(max_over(_col_max(b).float()))
        b_side = b_form(to_grid(b, f[..., None, :], t), engine)
    partial = grid_product(a, e[..., None], t, b_side, engine)
    if sum_over is not None:
        partial = sum_over(partial)
    return scaled(partial, e, f, t, dtype)


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
    """w [T, H], x [T, H, S] (fp32 or narrower) -> fp32 [T, S]: sum_h w[t, h] x[t, h, s] with every product
    exact in fp64 (24 + 24 significant bits), summed over h by the fixed tree in fp64, rounded once. The
    indexer's head-weighted sum: H is never split, so no exact integer form is needed."""
    return tree_sum(x.double().mul_(w.double()[:, :, None]), 1).float()


# -- transcendentals (fp64 formulas, rounded once to the input dtype) ------------------------------------
LN2_HI = 6.93147180369123816490e-01  # fdlibm: n * LN2_HI is exact for |n| < 2^11
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
_EXP_TERMS = 14  # Taylor terms of exp(r), |r| <= ln2 / 2: truncation below 1e-17 relative
_ATANH_TERMS = 13  # odd terms of atanh(s), |s| <= 0.1716


def _exp64(x: torch.Tensor, narrow: bool = False) -> torch.Tensor:
    """e^x in fp64. `narrow`: the caller rounds to fp32 or a narrower type, so x is clamped to
    [-708, 708] instead (2^n then one exponent-bit power): every result beyond that range rounds to the
    same 0 / inf / 1 there as with the wide clamp."""
    x = x.clamp(-708.0, 708.0) if narrow else x.clamp(-1100.0, 710.0)
    n = torch.round(x * INV_LN2)
    r = (x - n * LN2_HI).sub_(n * LN2_LO)
    p = torch.full_like(r, 1.0 / math.factorial(_EXP_TERMS - 1))
    for i in range(_EXP_TERMS - 2, -1, -1):
        p.mul_(r).add_(1.0 / math.factorial(i))
    return p.mul_(pow2(n)) if narrow else ldexp(p, n)


def _narrow(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, NaN kept."""
    y = _exp64(x.double(), _narrow(x.dtype))
    return torch.where(torch.isnan(x), x.double(), y).to(x.dtype)


def _log64(x: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(x)  # x = m 2^e, m in [0.5, 1)
    small = m < 0.7071067811865476
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
    return _log64(x.double()).to(x.dtype)


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


def pow_scalar(base: float, x: torch.Tensor) -> torch.Tensor:
    """base ** x for a positive scalar base: exp(x ln(base)) by the formula (RoPE's inverse frequencies)."""
    return exp(x.double() * math.log(base)).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _exp64(-x.double(), _narrow(x.dtype)).add_(1.0).reciprocal_().to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (xd / _exp64(-xd, _narrow(x.dtype)).add_(1.0)).to(x.dtype)


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
