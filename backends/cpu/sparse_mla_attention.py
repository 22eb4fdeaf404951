"""cpu backend: sparse_mla_attention (SPEC 2.4): per query block, one gather of the named latent rows
(in the cache's dtype, cast once to fp32) and two batched GEMMs (scores, then probabilities x values),
softmax in place between them. Backward: torch autograd through the same forward (without in-place ops).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.cpu._cache import flat, rows_of
from backends.layout import SeqLayout
from backends.ops import FLOATS

# Bound the gathered [tq, topk, d_qk] keys (elements): 4M fp32 = 16 MiB, a few queries at topk 2048.
GATHER_ELEMS = 1 << 22


def _block(q, cache, rows, valid, sm_scale, d_v, grad):
    """q [tq, H, d_qk] fp32, rows/valid [tq, n] -> (out [tq, H, d_v] fp32, lse [tq, H])."""
    tq, n = rows.shape
    keys = flat(cache).index_select(0, rows.reshape(-1)).view(tq, n, -1).float()
    full = bool(valid.all())
    if not full:  # rows of skipped indices are never read as values (they may hold NaN)
        keys = keys.masked_fill(~valid[..., None], 0) if grad else keys.masked_fill_(~valid[..., None], 0)
    p = torch.bmm(q * sm_scale, keys.transpose(1, 2))  # [tq, H, n]
    if not full:
        p = p.masked_fill(~valid[:, None, :], float("-inf")) if grad else p.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(p, dim=-1)
    shift = torch.where(torch.isneginf(lse), 0.0, lse)[..., None]
    prob = torch.exp(p - shift) if grad else p.sub_(shift).exp_()
    return torch.bmm(prob, keys[..., :d_v]), lse


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, H, d_qk]; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk]; indices: int32 [T, topk].
    Returns (out [T, H, d_v] dtype of q, lse [T, H] float32, or None if not return_lse).
    Differentiable in q and kv_cache. Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
    """
    t, h, d_qk = q.shape
    n = indices.shape[1]
    grad = torch.is_grad_enabled() and (q.requires_grad or kv_cache.requires_grad)
    outs, lses = [], []
    step = max(1, GATHER_ELEMS // max(1, n * d_qk))
    qf = q.float()
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0:
            continue
        if s == 0 or n == 0:
            outs.append(qf.new_zeros(q1 - q0, h, d_v))
            lses.append(torch.full((q1 - q0, h), float("-inf")))
            continue
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            idx = indices[a:z].to(torch.int64)
            valid = (idx >= 0) & (idx < s)
            rows = rows_of(layout, b, idx.clamp(0, s - 1), kv_cache)
            o, lse = _block(qf[a:z], kv_cache, rows, valid, sm_scale, d_v, grad)
            outs.append(o)
            lses.append(lse)
    if not outs:
        out, lse = q.new_zeros((t, h, d_v)), torch.full((t, h), float("-inf"))
    else:
        out, lse = torch.cat(outs).to(q.dtype), torch.cat(lses)
    return out, (lse if return_lse else None)


IMPL = OpImpl(
    sparse_mla_attention,
    OpCaps(FLOATS, ("ragged", "paged"), run_to_run=True, batch_invariant=True, differentiable=True),
)
