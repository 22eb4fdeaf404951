"""The exact integer GEMM of the layout-invariant mode (SPEC 12): a fixed-point grid per row of A and per
column of B, the integer product P = A_q B_q computed exactly, and the one rounding of P 2^n.

- `to_grid`: round_half_even(x 2^(t - e)) as int32, e the row's (column's) exponent, t `grid_bits(K)`.
- `digits`: a grid value as four signed int8 digits (base 2^7, |d| <= 64).
- `int_product`: P exactly, as int64, by one of five engines that give the same integers: "int8" (the
  16 digit pairs as seven level products, int8 x int8 -> int32 by torch._int_mm), "triton" (the same
  pairs by int8 `tl.dot` in a Triton kernel: GPUs), "ascend" (the seven level sums by a triton-ascend
  kernel's int8 `tl.dot`, combined in int64 by torch ops: Ascend NPUs, no fp64), "fp64" (two fp64 GEMMs
  whose partial sums are integers below 2^53) and "int64" (a plain integer matmul). `engine_for` picks
  one per product (by device, K and batching); `ENGINE` is GLM5_INVARIANT_GEMM's choice, else fp64.
- `round_scaled`: P 2^n rounded once to nearest even to the output dtype, in integer operations.
"""

from __future__ import annotations

import math
import os

import torch


# -- powers of two from their bits (torch.ldexp multiplies by pow(2, n), a vectorised pow) --------------
def pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n in fp64 for integer-valued n in [-1022, 1023], built from its exponent bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def pow2_32(n: torch.Tensor) -> torch.Tensor:
    """2^n in fp32 for integer-valued n in [-126, 127], built from its exponent bits (exact)."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def ldexp(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x * 2^n (fp64 x, integer-valued n in [-2044, 2046]) in two exact steps."""
    half = torch.div(n.to(torch.int64), 2, rounding_mode="floor")
    return x * pow2(half) * pow2(n.to(torch.int64) - half)


# -- the grid ---------------------------------------------------------------------------------------------
SLICE_BITS = 7  # a signed digit of the grid: |d| <= 64 fits int8, |d d'| <= 2^12
SLICES = 4
T_MAX = SLICE_BITS * SLICES - 1  # 27: |q| <= 2^27 is four digits, the top one |d| <= 64 too
INT_BITS = 62  # |P| <= K 2^(2t) <= 2^62: int64, with room for the sign


def grid_bits(k: int) -> int:
    """t = min(27, floor((62 - ceil(log2 K)) / 2)): a grid value is four signed int8 digits and the
    integer product |P| <= K 2^(2t) <= 2^62 fits int64 (t = 24 at K = 6144 and 16384, 25 at 2048)."""
    return min(T_MAX, (INT_BITS - math.ceil(math.log2(max(k, 1)))) // 2)


def scale_exponent(absmax: torch.Tensor) -> torch.Tensor:
    """e (int32) with absmax <= 2^e (0 for a zero max)."""
    return torch.frexp(absmax.float())[1]


def grid_values(x: torch.Tensor, e: torch.Tensor, t: int) -> torch.Tensor:
    """round_half_even(x 2^(t - e)) (|.| <= 2^t) as integer-valued floats: fp32 (bf16 / fp16 widened
    exactly) times two exact powers of two 2^h1, 2^h2 (h1 + h2 = t - e; no step leaves fp32's normal
    range for a value that rounds to a non-zero integer), rounded in fp32 (above 2^23 an fp32 is an
    integer already: the scaled input itself, exact); fp64 input in fp64."""
    n = t - e.to(torch.int32)
    h1 = torch.div(n, 2, rounding_mode="floor")
    if x.dtype == torch.float64:
        return (x * pow2(h1) * pow2(n - h1)).round_()
    return (x.float() * pow2_32(h1)).mul_(pow2_32(n - h1)).round_()


def to_grid(x: torch.Tensor, e: torch.Tensor, t: int) -> torch.Tensor:
    """`grid_values` as int32."""
    return grid_values(x, e, t).to(torch.int32)


def digits(q: torch.Tensor) -> torch.Tensor:
    """int32 q [..., R, C] with |q| <= 2^27 -> int8 [SLICES, ..., R, C], most significant first:
    q = sum_i d_i 2^(7 (3 - i)), the low digits in [-64, 63] (balanced), the top one in [-64, 64]."""
    out = []
    for _ in range(SLICES - 1):
        low = ((q + 64) & 127) - 64
        out.append(low)
        q = (q - low) >> SLICE_BITS
    out.append(q)
    return torch.stack(out[::-1]).to(torch.int8)


def _padded_k(k: int) -> int:
    """K zero-padded for torch._int_mm's CPU shape rules: a multiple of 8, at least 8 (zeros add nothing;
    torch 2.13's CPU kernel is wrong for K = 1)."""
    return max(8, -(-k // 8) * 8)


def _digit_blocks(q: torch.Tensor, reverse: bool) -> torch.Tensor:
    """int32 q [R, K] -> int8 [R, SLICES Kp]: q's digits side by side along K, each block zero-padded to
    `_padded_k`; most significant first, or least significant first (`reverse`)."""
    d = digits(q)  # [S, R, K]
    if reverse:
        d = d.flip(0)
    kp = _padded_k(q.shape[-1])
    if kp != q.shape[-1]:
        d = torch.nn.functional.pad(d, (0, kp - q.shape[-1]))
    return d.permute(1, 0, 2).reshape(q.shape[0], SLICES * kp)


def int8_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b_t int8 [N, K]^T -> int32 [M, N] by torch._int_mm, K zero-padded to `_padded_k`."""
    pad = _padded_k(a.shape[-1]) - a.shape[-1]
    if pad:
        a, b_t = torch.nn.functional.pad(a, (0, pad)), torch.nn.functional.pad(b_t, (0, pad))
    return torch._int_mm(a, b_t.T)


def _level_sums(a_q: torch.Tensor, b_blocks: torch.Tensor) -> list[torch.Tensor]:
    """The level sums S_l = sum_{i + j = l} d_i(a) d_j(b) (int32 [M, N], l = 0 .. 6) by one int8 x int8 ->
    int32 product per level: a's digits side by side along K (d_0 .. d_3) and b's (`b_form` "int8":
    [N, S Kp], d_3 .. d_0), so a level's pairs (i, l - i), i = lo .. hi, are one contiguous K range of each:
    the product over it is their sum (|S_l| <= 4 K 2^12 < 2^31 for K < 131,072)."""
    kp = b_blocks.shape[-1] // SLICES
    a_blocks = _digit_blocks(a_q, reverse=False)
    sums = []
    for level in range(2 * SLICES - 1):
        lo, hi = max(0, level - SLICES + 1), min(level, SLICES - 1)
        first = SLICES - 1 - level + lo  # b's block of digit l - lo
        n = hi - lo + 1
        sums.append(
            torch._int_mm(a_blocks[:, lo * kp : (lo + n) * kp], b_blocks[:, first * kp : (first + n) * kp].T)
        )
    return sums


def _levels_fp64(sums: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """P = hi 2^21 + lo from the level sums, both exact fp64 integers: hi = S_0 2^21 + S_1 2^14 + S_2 2^7
    + S_3 (|hi| < K 2^34 < 2^53), lo = S_4 2^14 + S_5 2^7 + S_6."""
    d = [s.double() for s in sums]
    hi = d[0].mul_(2.0**21).add_(d[1], alpha=2.0**14).add_(d[2], alpha=2.0**7).add_(d[3])
    lo = d[4].mul_(2.0**14).add_(d[5], alpha=2.0**7).add_(d[6])
    return hi, lo


def _int8_product(a_q: torch.Tensor, b_blocks: torch.Tensor) -> torch.Tensor:
    """P = a_q @ b_q exactly, as int64, from the int8 digit products (`_level_sums`): P = hi 2^21 + lo."""
    m, n = a_q.shape[-2], b_blocks.shape[-2]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.int64)
    hi, lo = _levels_fp64(_level_sums(a_q, b_blocks))
    return (hi.to(torch.int64) << 21).add_(lo.to(torch.int64))


def _triton_product(a_q: torch.Tensor, b_digits_t: torch.Tensor) -> torch.Tensor:
    """P = a_q @ b_q exactly, as int64, by the Triton kernel of the same digit products (one launch for
    every batch entry): int8 x int8 -> int32 `tl.dot` per digit pair, the pairs of a level summed in that
    int32 accumulator, the levels combined in int64 (kernels_cuda/invariant_gemm.py). A GPU's tensors, or
    CPU tensors under TRITON_INTERPRET=1."""
    from kernels_cuda.invariant_gemm import digit_product  # triton: the cuda backend's dependency only

    batch = torch.broadcast_shapes(a_q.shape[:-2], b_digits_t.shape[:-2])
    a_q = a_q.expand(batch + a_q.shape[-2:]).reshape(-1, *a_q.shape[-2:])
    b = b_digits_t.expand(batch + b_digits_t.shape[-2:]).reshape(-1, *b_digits_t.shape[-2:])
    out = digit_product(digits(a_q), b.contiguous(), SLICE_BITS)
    return out.view(batch + out.shape[-2:])


def _ascend_product(a_q: torch.Tensor, b_digits: torch.Tensor) -> torch.Tensor:
    """P = a_q @ b_q exactly, as int64, from the triton-ascend kernel's seven int32 level sums (one launch
    for every batch entry; kernels_ascend/invariant_gemm.py), combined by torch ops in int64:
    P = sum_l S_l 2^(7 (6 - l)) by Horner's rule (no fp64: the NPU's cube has none). An NPU's tensors, or
    CPU tensors under TRITON_INTERPRET=1 with triton-ascend installed."""
    from kernels_ascend.invariant_gemm import level_sums  # triton-ascend: the ascend backend's dependency

    batch = torch.broadcast_shapes(a_q.shape[:-2], b_digits.shape[:-3])
    a_q = a_q.expand(batch + a_q.shape[-2:]).reshape(-1, *a_q.shape[-2:])
    b = b_digits.expand(batch + b_digits.shape[-3:]).reshape(-1, *b_digits.shape[-3:])  # a view if it can
    sums = level_sums(digits(a_q), b, SLICE_BITS)  # int32 [Bt, 7, M, N]
    p = sums[:, 0].to(torch.int64)
    for level in range(1, 2 * SLICES - 1):
        p = (p << SLICE_BITS).add_(sums[:, level])
    return p.view(batch + p.shape[-2:])


def halves(q: torch.Tensor) -> torch.Tensor:
    """Integer-valued q (fp32 or fp64, |q| <= 2^27) -> fp64 [2, ...]: h = round_half_even(q 2^-14) and
    l = q - h 2^14 (|l| <= 2^13), every step exact in q's own float type."""
    h = (q * 2.0**-14).round_()
    return torch.stack([h, q - h * 2.0**14]).double()


def _fp64_product(hl: torch.Tensor, b_d: torch.Tensor, t: int) -> torch.Tensor:
    """P = a_q @ b_q exactly, as int64, by fp64 GEMMs of a_q's `halves` (h, l stacked on M, one
    product): every partial sum of h b (|h| <= 2^(t - 14) + 1) and of l b (|l| <= 2^13) is an integer
    below 2^(13 + t + log2 K) <= 2^53 (K chunked by 2^(40 - t) where it would not be), combined in
    int64: P = (h b) 2^14 + l b."""
    k, chunk = hl.shape[-1], 1 << (40 - t)
    out = None
    for z in range(0, max(k, 1), chunk):
        part = torch.matmul(hl[..., z : z + chunk], b_d[..., z : z + chunk, :]).to(torch.int64)
        out = part if out is None else out + part
    return (out[0] << 14).add_(out[1])


def b_form(b_q: torch.Tensor, engine: str) -> torch.Tensor:
    """b's grid [..., K, N] in the form `engine` multiplies: fp64 integers, int64, int8 digits side by side
    along K, least significant first ([..., N, S Kp], "int8": `_level_sums`), int8 digits stacked on N
    and transposed ([..., S N, K], "triton") or transposed per digit ([..., S, N, K], "ascend")."""
    if engine == "fp64":
        return b_q.double()
    if engine == "int64":
        return b_q.to(torch.int64)
    b_t = b_q.transpose(-1, -2)
    if engine == "int8":
        flat = b_t.reshape(-1, *b_t.shape[-2:])
        blocks = torch.empty(
            flat.shape[0], flat.shape[1], SLICES * _padded_k(flat.shape[2]), dtype=torch.int8
        )
        for i, x in enumerate(flat):
            blocks[i] = _digit_blocks(x, reverse=True)
        return blocks.view(*b_t.shape[:-1], -1)
    d = digits(b_t).movedim(0, -3)  # [..., S, N, K]
    return d.contiguous() if engine == "ascend" else d.flatten(-3, -2).contiguous()


def int_product(a_q: torch.Tensor, b: torch.Tensor, engine: str, t: int) -> torch.Tensor:
    """The exact integer product P = a_q @ b_q (int32 grids of t bits; b in `b_form`) as int64, by
    `engine`:
    "int8" (int8 digit products, int8 x int8 -> int32 by torch._int_mm), "triton" (the same digit
    products by a Triton kernel's int8 `tl.dot`), "ascend" (the level sums by a triton-ascend kernel's
    int8 `tl.dot`), "fp64" (two fp64 GEMMs of exact integer partial sums) or "int64" (the plain integer
    matmul). All five are the same integers."""
    if engine == "fp64":
        return _fp64_product(halves(a_q.double()), b, t)
    if engine == "int64":
        return torch.matmul(a_q.to(torch.int64), b)
    if engine == "triton":
        return _triton_product(a_q, b)
    if engine == "ascend":
        return _ascend_product(a_q, b)
    if a_q.dim() == 2 and b.dim() == 2:
        return _int8_product(a_q, b)
    batch = torch.broadcast_shapes(a_q.shape[:-2], b.shape[:-2])
    a_q = a_q.expand(batch + a_q.shape[-2:]).reshape(-1, *a_q.shape[-2:])
    b = b.expand(batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.empty(a_q.shape[0], a_q.shape[-2], b.shape[-2], dtype=torch.int64)
    for i in range(a_q.shape[0]):  # torch._int_mm is 2-D only
        out[i] = _int8_product(a_q[i], b[i])
    return out.view(batch + out.shape[-2:])


def grid_product(a: torch.Tensor, e: torch.Tensor, t: int, b: torch.Tensor, engine: str) -> torch.Tensor:
    """P = grid(a) @ b_q (a float [..., M, K], e [..., M, 1]; b in `b_form`) exactly, as int64."""
    if engine == "fp64":  # the halves straight from the float grid: no int32 round trip
        return _fp64_product(halves(grid_values(a, e, t)), b, t)
    return int_product(to_grid(a, e, t), b, engine, t)


def _round_odd_fp32(
    ph: torch.Tensor, pl: torch.Tensor, n_row: torch.Tensor, n_col: torch.Tensor, shift: int = 14
) -> torch.Tensor:
    """(ph 2^shift + pl) 2^(n_row + n_col) rounded once to fp32, for two exact fp64 parts of P (the fp64
    engine's halves, shift 14; the int8 engine's level sums, shift 21): their sum rounded to odd in fp64
    (TwoSum's exact error tells which neighbour is odd), scaled exactly, then one cast. Rounding to odd at
    53 bits and then to nearest at 24 is the one rounding to nearest (p >= 24 + 2), so the bits are
    `round_scaled`'s."""
    x = ph * float(1 << shift)
    s = x + pl
    bb = s - x
    err = (x - (s - bb)).add_(pl - bb)
    mag = s.abs().view(torch.int64)
    inexact = err != 0
    above = inexact & ((err > 0) != (s > 0))  # |s| > |P|: the odd neighbour is s or the one below
    mag = (mag - above.to(torch.int64)) | inexact.to(torch.int64)  # inexact: the odd of the two around P
    r = torch.copysign(mag.view(torch.float64), s.add_(0.0))  # s + 0: an exact zero P is +0
    return r.mul_(pow2(n_row)[..., :, None]).mul_(pow2(n_col)[..., None, :]).float()


def rounded_product(
    a: torch.Tensor,
    e: torch.Tensor,
    t: int,
    b: torch.Tensor,
    f: torch.Tensor,
    engine: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """grid(a) @ b_q times 2^(e_i + f_j - 2t), rounded once to dtype (e [..., M], f [..., N])."""
    if engine == "fp64" and dtype == torch.float32 and a.shape[-1] <= 1 << (40 - t):
        hl = torch.matmul(halves(grid_values(a, e[..., None], t)), b)
        return _round_odd_fp32(hl[0], hl[1], e.to(torch.int64) - t, f.to(torch.int64) - t)
    if (
        engine == "int8"
        and dtype == torch.float32
        and a.dim() == 2
        and b.dim() == 2
        and a.numel()
        and b.numel()
    ):
        hi, lo = _levels_fp64(_level_sums(to_grid(a, e[..., None], t), b))
        return _round_odd_fp32(hi, lo, e.to(torch.int64) - t, f.to(torch.int64) - t, shift=21)
    return scaled(grid_product(a, e[..., None], t, b, engine), e, f, t, dtype)


#: (significant bits, minimum normal exponent) of each output dtype
_FORMAT = {
    torch.float32: (24, -126),
    torch.bfloat16: (8, -126),
    torch.float16: (11, -14),
    torch.float64: (53, -1022),
}


def _bit_length(a: torch.Tensor) -> torch.Tensor:
    """L with 2^(L-1) <= a < 2^L (0 for 0), a int64 >= 0: the fp32 conversion's exponent, which is L or
    L + 1 whatever that conversion rounds, corrected by one shift."""
    e = torch.frexp(a.float())[1].to(torch.int64)
    return e - ((a >> (e - 1).clamp_min(0)) == 0).to(torch.int64) * (e > 0)


def _pow2_any(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^n exactly in fp32 (n in [-149, 127], subnormal below -126) or fp64 (n in [-1022, 1023])."""
    if dtype == torch.float64:
        return pow2(n)
    n = n.to(torch.int32)
    normal = ((n.clamp(-126, 127) + 127) << 23).view(torch.float32)
    sub = (torch.ones_like(n) << (n + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(n < -126, sub, normal)


def _round_fp32(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`round_scaled` to fp32, the float built from its bits: keep 24 significant bits of |P| (fewer where
    P 2^n is subnormal: its ulp is 2^-149), round half to even in integers, then the exponent field
    n + shift + 149 (0 for a subnormal) added above the 24-bit q, whose carry into the exponent is the
    rounding's own; past the range, inf."""
    a = p.abs()
    e = ((a.float().view(torch.int32) >> 23) - 126).to(torch.int64).clamp_min_(0)  # L or L + 1
    length = e - (a >> (e - 1).clamp_min(0) == 0).to(torch.int64) * (e > 0)
    shift = torch.maximum(length - 24, -149 - n).clamp_max_(63)  # < 0: a short q moved up, exact
    right = shift.clamp_min(0)
    one = (right > 0).to(torch.int64)
    bias = (one << (right - one)) - one + ((a >> right) & one)  # half - 1, + 1 if q is odd: to even
    q = ((a + bias) >> right) << (-shift).clamp_min_(0)
    bits = ((n + shift + 149) << 23).add_(q).clamp_(0, 0x7F800000).masked_fill_(a == 0, 0).to(torch.int32)
    out = bits.view(torch.float32)
    return torch.where(p < 0, -out, out)


def round_scaled(p: torch.Tensor, n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """P 2^n (P int64, n integer [.., M, N]) rounded once, to nearest even, to dtype, in integer
    operations: keep the dtype's significant bits of |P| (fewer where the result is subnormal), round
    the rest away in integers, then one exact product q 2^(n + shift) (inf past the dtype's range)."""
    n = n.to(torch.int64)
    if dtype == torch.float32:
        return _round_fp32(p, n)
    bits, emin = _FORMAT[dtype]
    a = p.abs()
    shift = torch.maximum(_bit_length(a) - bits, emin - bits + 1 - n).clamp(0, 63)
    q = a >> shift
    rest = a - (q << shift)
    half = torch.where(shift > 0, torch.ones_like(shift) << (shift - 1).clamp_min(0), 0)
    q = q + ((rest > half) | ((rest == half) & (shift > 0) & ((q & 1) == 1))).to(torch.int64)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q = torch.where(p < 0, -q, q).to(wide)  # |q| <= 2^bits: exact
    m = n + shift  # >= emin - bits + 1: 2^m is a (subnormal) number of `wide`
    top = 1023 if wide == torch.float64 else 127
    h = m.clamp_max(top)  # past the range the second factor overflows to inf, as the one rounding does
    return (q * _pow2_any(h, wide) * _pow2_any((m - h).clamp_max(top), wide)).to(dtype)


def scaled(
    partial: torch.Tensor, e_row: torch.Tensor, f_col: torch.Tensor, t: int, dtype: torch.dtype
) -> torch.Tensor:
    """The integer product P (int64) times 2^(e_i + f_j - 2t), rounded once to dtype (`round_scaled`)."""
    n = e_row.to(torch.int64)[..., :, None] + f_col.to(torch.int64)[..., None, :] - 2 * t
    return round_scaled(partial, n, dtype)


def _int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI; AMX CPUs have them)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


GEMM_ENV = "GLM5_INVARIANT_GEMM"
ENGINES = ("int8", "fp64", "int64", "triton", "ascend")
#: the largest K of the one-GEMM fp32 form (certified.py): about K^1.5 2^-29 of the elements are
#: undecided (Gaussian data), each an exact dot product of K at about 100x a GEMM's cost per term; above
#: it two fp64 GEMMs or the int8 digit products are cheaper (docs/performance.md)
ONE_GEMM_K_MAX = 4096


def _engine() -> str:
    """The exact integer GEMM this process uses by default (all give the same integers): GLM5_INVARIANT_GEMM,
    else fp64 (its fp32 results from one certified GEMM up to K = ONE_GEMM_K_MAX)."""
    value = os.environ.get(GEMM_ENV)
    if value is not None:
        if value not in ENGINES:
            raise ValueError(f"{GEMM_ENV}: expected one of {', '.join(ENGINES)}, got {value!r}")
        return value
    return "fp64"


ENGINE = _engine()
CHOSEN = GEMM_ENV in os.environ  # read once, as ENGINE is
INT8_DOT = hasattr(torch, "_int_mm") and _int8_dot()


def engine_for(device: torch.device, k: int = 0, batched: bool = False) -> str:
    """The engine for a product of length k on `device` (all give the same integers): GLM5_INVARIANT_GEMM
    when set; else "triton" on a CUDA device (an H200 has about 1/30 the fp64 rate of its int8 one),
    "ascend" on an Ascend NPU (its cube unit has no fp64, its vector unit runs int64 as scalar code); on a
    CPU "int8" for a 2-D product with k > ONE_GEMM_K_MAX where the CPU has int8 dot products (there the
    16 digit products by torch._int_mm beat two fp64 GEMMs: docs/performance.md), else "fp64" (one
    certified GEMM below that K; torch._int_mm is 2-D only and, without VNNI, 14-19x slower than an fp32
    GEMM)."""
    if CHOSEN:
        return ENGINE
    if device.type == "cuda":
        return "triton"
    if device.type == "npu":
        return "ascend"
    if INT8_DOT and not batched and k > ONE_GEMM_K_MAX:
        return "int8"
    return "fp64"
