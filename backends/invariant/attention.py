"""sparse_mla_attention's formula in the layout-invariant mode (SPEC 12 "Backend ops"), on gathered rows:
what the cpu and cuda backends run on their own query blocks and gathers (the reference writes the same
steps inline), so every (token, head) gets the bits the SPEC writes down."""

from __future__ import annotations

import torch

from backends.invariant import engine as invariant


def exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    d_v: int,
    sm_scale: float,
    engine: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tq, H, d_qk] fp32 (unscaled), keys [tq, n, d_qk] fp32 (invalid rows zero), valid [tq, n] ->
    (out [tq, H, d_v] fp32, lse [tq, H]), every (token, head) from its own row only: p = exact(q, K^T)
    sm_scale, -inf where invalid; lse = the fixed-tree log-sum-exp; out = exact(exp(p - lse), V) (0 where
    lse = -inf). `engine`: the exact GEMM (`exact_matmul`'s; all give the same integers)."""
    p = invariant.exact_matmul(q, keys.transpose(1, 2), engine=engine) * sm_scale
    p.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = invariant.logsumexp(p, -1)
    prob = invariant.exp(p - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return invariant.exact_matmul(prob, keys[..., :d_v], engine=engine), lse
