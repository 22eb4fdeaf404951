"""The fp64 engine's fp32 results from one fp64 GEMM (SPEC 12): the product of the grids at their values,
an error bound that holds for any summation order, and the exact integer product only where the bound
cannot decide the one rounding.

C_ij = RN32(X_ij), X_ij = P_ij 2^(e_i + f_j - 2t) = sum_k a_ik b_kj with a_ik = Â_ik 2^(e_i - t) and
b_kj = B̂_kj 2^(f_j - t) (both exact in fp64). One fp64 GEMM gives v_ij with, in any order, with or
without fused multiply-adds, |v_ij - X_ij| <= gamma_K sum_k |a_ik b_kj| <= gamma_K ||a_i|| ||b_j||
(gamma_K = K u / (1 - K u), u = 2^-53; Cauchy-Schwarz; no term is near fp64's underflow: every
non-zero a_ik b_kj is at least 2^-350). r = RN32(v) is RN32(X) wherever every value within that bound
of v lies strictly inside r's rounding interval (`undecided`: the narrower half-gap around r, tested with
a bound of 2 gamma_K, which covers the norms' and the test's own roundings). Where the test
fails, P_ij is computed exactly (int64) and rounded by `round_scaled`, the rounding's definition; where
many fail, the whole product takes the two-GEMM form (`rounded_product`). Either way every element is
RN32(X): the bits of every other engine, by construction.
"""

from __future__ import annotations

import torch

from backends.invariant.gemm import ONE_GEMM_K_MAX, pow2, round_scaled, rounded_product

FORM = "fp64c"  # the weight side's cache key next to the engines' forms
K_MAX = ONE_GEMM_K_MAX  # the largest K it takes (gemm.py says why)


def applies(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, t: int, engine: str) -> bool:
    """fp32 results of fp32 / bf16 / fp16 operands on the fp64 engine, K within the exact halves' range
    (every scaled operand then inside fp64's normal range)."""
    return (
        engine == "fp64"
        and dtype == torch.float32
        and a.dtype != torch.float64
        and b.dtype != torch.float64
        and a.shape[-1] <= min(K_MAX, 1 << (40 - t))
    )


def _norms(x: torch.Tensor) -> torch.Tensor:
    """2-norms over the last dim in fp64 (a sum of K products in some order, then sqrt: within about
    (K + 2) u of the true ones, well inside the bound's 2x)."""
    return torch.linalg.vecdot(x, x).sqrt_()


def b_form(b_q: torch.Tensor, f: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """b's grid at its values, B̂ 2^(f_j - t), transposed (fp64 [..., N, K], exact: the undecided
    elements' columns are its rows), and its column norms [..., N]."""
    b_t = b_q.transpose(-1, -2).double().mul_(pow2(f.to(torch.int64) - t)[..., :, None]).contiguous()
    return b_t, _norms(b_t)


def undecided(v: torch.Tensor, r: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Where r = RN32(v) may not be RN32(X), |X - v| <= bound = row col 2^-24: not where
    |v - r| + bound < h(r), h(r) = 2^(E - 24) for r in [2^E, 2^(E+1)), 2^(E - 25) when |r| = 2^E (the gap
    below a power of two is half), the narrower half-gap around r: then every X within the bound of v lies
    strictly inside r's rounding interval. Tested as 2^24 |v - r| + row col < 2^E or 2^(E - 1), built from
    r's bits (|r| bits - 1 borrows from the exponent exactly when the significand is zero); zero, subnormal
    and infinite r never pass. The 2x in `row` covers gamma_K's 1 / (1 - K u), the norms' and this test's
    roundings (|v - r| is exact: r is v's first 24 bits, rounded)."""
    mag = (r.view(torch.int32) & 0x7FFFFFFF).clamp_min_(1).sub_(1)
    h = (mag & 0x7F800000).view(torch.float32)  # 2^E; 2^(E - 1) at a power of two; 0 at 0, 2^-126, subnormals
    return torch.sub(v, r).abs_().mul_(2.0**24).addcmul_(row, col) >= h


def rounded_fp32(
    a: torch.Tensor, e: torch.Tensor, t: int, form: tuple[torch.Tensor, torch.Tensor], f: torch.Tensor
) -> torch.Tensor:
    """RN32(grid(a) @ b_q 2^(e_i + f_j - 2t)) (a [..., M, K], e [..., M], f [..., N]; form = `b_form`)."""
    b_t, nb = form
    k = a.shape[-1]
    # a's grid at its values, round_half_even(a 2^(t - e)) 2^(e - t), in fp64 (every step exact: the
    # integers of `grid_values`), the powers of two from their exponent bits
    bits = e.to(torch.int64).unsqueeze(-1) << 52
    up, down = (
        (((1023 + t) << 52) - bits).view(torch.float64),
        (bits + ((1023 - t) << 52)).view(torch.float64),
    )
    a_s = (a.double() * up).round_().mul_(down)
    v = torch.matmul(a_s, b_t.transpose(-1, -2))  # [..., M, N]
    r = v.float()
    bound = _norms(a_s).mul_((k + 2) * 2.0**-28)  # 2^24 2 gamma_K ||a_i||, times ||b_j|| below
    idx = undecided(v, r, bound[..., :, None], nb[..., None, :]).nonzero()  # [n, batch dims + 2]: few
    n = idx.shape[0]
    if n == 0:
        return r
    if n * 32 > r.numel():  # many: the two-GEMM form is cheaper than n dot products
        b_int = (b_t * pow2(t - f.to(torch.int64))[..., :, None]).transpose(-1, -2)
        return rounded_product(a, e, t, b_int, f, "fp64", torch.float32)
    batch = r.shape[:-2]
    a_s, b_t = a_s.expand(batch + a_s.shape[-2:]), b_t.expand(batch + b_t.shape[-2:])
    e, f = e.expand(batch + e.shape[-1:]).to(torch.int64), f.expand(batch + f.shape[-1:]).to(torch.int64)
    e_n, f_n = e[tuple(idx[:, :-1].T)], f[(*idx[:, :-2].T, idx[:, -1])]
    p = torch.empty(n, dtype=torch.int64)
    step = max(1, (1 << 18) // max(k, 1))  # elements per pass: the [step, K] operands stay in cache
    for z in range(0, n, step):
        at = idx[z : z + step]
        a_q = a_s[tuple(at[:, :-1].T)].mul_(pow2(t - e_n[z : z + step])[:, None]).to(torch.int64)
        b_q = b_t[(*at[:, :-2].T, at[:, -1])].mul_(pow2(t - f_n[z : z + step])[:, None]).to(torch.int64)
        p[z : z + step] = a_q.mul_(b_q).sum(-1)  # the grids' integers (exact), P exact: |P| <= 2^62
    r[tuple(idx.T)] = round_scaled(p, e_n + f_n - 2 * t, torch.float32)
    return r
