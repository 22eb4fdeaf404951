"""Comparators of the FP8 ops (SPEC 7.x tolerances), merged into `conformance.compare.COMPARATORS`.

fp8_exact        e4m3 tensors bit for bit (codes of fp8_quant_group; -0.0 != +0.0, as any cast).
fp8_gemm         fp8_block_matmul / fp8_grouped_matmul: |a - r| <= ulps * ulp_out(r) + rtol * mag, where
                 mag[m, n] = sum_kb |x_q[m, kb]| . |w_q[n, kb]| * x_scale[m, kb] * w_scale_inv[n//128, kb]
                 (the magnitude of the promoted sum): a backend's fp32 accumulation order inside and
                 across K blocks is free, within rtol of the terms it adds. Defaults ulps 1, rtol 2^-17
                 (fp32 sums of 128 terms, worst case); Hopper's ~14-bit wgmma accumulator needs more, which
                 a backend states in its manifest.
fp8_indexer_topk the strict tie rule (or a declared near-tie tolerance) on the reference FP8 logits, as
                 `indexer_topk_indices` does for the float indexer.
fp8_cache_indexer_topk  indexer_topk on the FP8 indexer cache (SPEC 7.8): fp8_indexer_topk's check on the
                 e4m3 inputs the backend makes (q quantized as the contract does, keys and scales read
                 from the cache).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from backends.formats import index_cache_views
from backends.reference.fp8_indexer_logits import quantize_index_queries
from conformance.compare import Check, Context, _header, _worst, close, exact, ulp_of
from conformance.topk_contract import _near_ties, _strict, _weak

E4M3 = torch.float8_e4m3fn


def fp8_exact(name: str, a: Any, r: torch.Tensor, ctx: Context, **_: float) -> Check:
    bad = _header(name, a, r)
    if bad:
        return bad
    return exact(name, a.detach().cpu().view(torch.uint8), r.view(torch.uint8), ctx)


def _gemm_magnitude(x_q, x_scale, w_q, w_scale_inv) -> torch.Tensor:
    """[M, N] fp64: sum over K blocks of |x| . |w| times both scales."""
    k, n = x_q.shape[1], w_q.shape[0]
    mag = torch.zeros(x_q.shape[0], n, dtype=torch.float64)
    ws = w_scale_inv.double().repeat_interleave(128, 0)[:n]
    for kb in range(-(-k // 128)):
        c = slice(kb * 128, min(k, (kb + 1) * 128))
        d = x_q[:, c].double().abs() @ w_q[:, c].double().abs().T
        mag += d * x_scale[:, kb].double().abs()[:, None] * ws[None, :, kb].abs()
    return mag


def fp8_gemm(
    name: str, a: Any, r: torch.Tensor, ctx: Context, *, ulps: float = 1.0, rtol: float = 2.0**-17, **_: float
) -> Check:
    bad = _header(name, a, r)
    if bad:
        return bad
    args = ctx.args
    if "group_offsets" in args:
        mag = torch.zeros(r.shape, dtype=torch.float64)
        offs = args["group_offsets"].tolist()
        for e in range(args["w_q"].shape[0]):
            rows = slice(offs[e], offs[e + 1])
            if offs[e] < offs[e + 1]:
                mag[rows] = _gemm_magnitude(
                    args["x_q"][rows], args["x_scale"][rows], args["w_q"][e], args["w_scale_inv"][e]
                )
    else:
        mag = _gemm_magnitude(args["x_q"], args["x_scale"], args["w_q"], args["w_scale_inv"])
        if args.get("bias") is not None:
            mag = mag + args["bias"].double().abs()[None, :]
    res = close(name, a, r, ctx, rtol=0.0, atol=0.0)
    if not res.ok and "positions differ" in res.message:
        return res
    a64, r64 = a.detach().cpu().double(), r.double()
    fin = torch.isfinite(r64)
    allowed = ulps * ulp_of(r, r.dtype) + rtol * mag
    err = torch.where(fin, (a64 - r64).abs(), 0.0)
    excess = torch.where(fin, err - allowed, 0.0)
    n_bad = int((excess > 0).sum())
    metrics = res.metrics | {"mismatches": n_bad, "ulps": ulps, "rtol": rtol}
    if r.numel():
        metrics["max_err_over_mag"] = float((err / mag.clamp_min(1e-300)).max())
    msg = (
        f"{name}: {n_bad} / {r.numel()} elements beyond {ulps:g} ulp of {r.dtype} + {rtol:g} * sum|terms|"
        if n_bad
        else ""
    )
    return Check(name, n_bad == 0, msg, metrics, _worst(a64, r64, excess, allowed))


def fp8_indexer_topk(name: str, a: Any, r: torch.Tensor, ctx: Context, **params: float) -> Check:
    rtol, atol = params.get("near_tie_rtol", 0.0), params.get("near_tie_atol", 0.0)
    well_formed = isinstance(a, torch.Tensor) and a.shape == r.shape and a.dtype == r.dtype
    if _strict(ctx) and (not (rtol or atol) or not well_formed):
        return exact(name, a, r, ctx)
    args = ctx.args
    logits = ctx.reference.fp8_indexer_logits(
        args["q"], args["k_cache"], args["k_scale"], args["weights"], args["layout"]
    ).double()
    # structural ties are judged on the de-quantized keys (same codes and same scale)
    deq = dict(args, k_cache=args["k_cache"].float() * args["k_scale"].unsqueeze(-1))
    if _strict(ctx):
        if logits.shape[1] == 0:
            return exact(name, a, r, ctx)
        return _near_ties(name, a.detach().cpu(), r, logits, deq, rtol, atol)
    if not well_formed:
        return exact(name, a, r, ctx)
    limit = torch.zeros(logits.shape[0], dtype=torch.int64)
    for q0, q1, s in args["layout"].request_bounds():
        i = torch.arange(q1 - q0)
        limit[q0:q1] = (s - (q1 - q0) + i + 1).clamp(0, s)
    return _weak(name, a.detach().cpu(), r, logits, limit)


def fp8_cache_indexer_topk(name: str, a: Any, r: torch.Tensor, ctx: Context, **params: float) -> Check:
    args = ctx.args
    keys, scales = index_cache_views(args["k_cache"])
    q8, w8 = quantize_index_queries(args["q"], args["weights"])
    fp8_args = dict(args, q=q8, k_cache=keys, k_scale=scales, weights=w8)
    return fp8_indexer_topk(name, a, r, replace(ctx, args=fp8_args), **params)


COMPARATORS = {
    "fp8_exact": fp8_exact,
    "fp8_gemm": fp8_gemm,
    "fp8_indexer_topk": fp8_indexer_topk,
    "fp8_cache_indexer_topk": fp8_cache_indexer_topk,
}
