"""Sparse MLA attention in the absorbed form (SPEC 2.4).

    valid(t) = { j in indices[t] : 0 <= j < seqlens_k[b(t)] }
    p[t,h,j] = sm_scale * dot(q[t,h], K_j)                 fp32
    lse[t,h] = logsumexp_j p[t,h,j]                        natural log
    out[t,h] = sum_j exp(p[t,h,j] - lse[t,h]) * K_j[:d_v]
    empty valid(t): out = 0, lse = -inf

Only rows named by a valid index are read (unused rows may hold NaN). Duplicates count twice.
Differentiable in q and kv_cache: `backward` (the op's declared backward) from the saved lse,
    p = exp(s - lse), dS = p * (dP - sum_j p dP) + p * dlse,  dq = sm_scale * dS K,
    dK_j += sm_scale * dS^T q,  dK_j[:d_v] += p^T dO   (rows summed in index order, fp32)
"""

from __future__ import annotations

import torch

from backends import invariant
from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.counters import reference_op
from backends.decls._common import FLOATS
from backends.layout import SeqLayout
from backends.reference._cache import gather_rows, keys_at
from backends.reference.fp8_sparse_mla_attention import IMPL as FP8_ATTENTION

# Bound the gathered [tq, topk, d_qk] fp32 keys (elements).
_GATHER_ELEMS = 1 << 24


@reference_op("sparse_mla_attention")
def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, h, d_qk = q.shape  # q: [T, H, d_qk]
    n_idx = indices.shape[1]  # indices: [T, topk]
    outs, lses = [], []
    # the layout-invariant mode (SPEC 12): exact products, fixed-tree log-sum-exp, formula exp
    exact = invariant.active()
    mm = invariant.exact_matmul if exact else torch.matmul
    logsumexp = invariant.logsumexp if exact else torch.logsumexp
    exp = invariant.exp if exact else torch.exp
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        step = max(1, _GATHER_ELEMS // max(1, n_idx * d_qk))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            idx = indices[a:z].to(torch.int64)  # [tq, topk]
            valid = (idx >= 0) & (idx < s)
            keys = q.new_zeros((z - a, n_idx, d_qk), dtype=torch.float32)
            keys = keys.index_put((valid,), gather_rows(kv_cache, layout, b, idx[valid]).float())
            p = mm(q[a:z].float(), keys.transpose(1, 2)) * sm_scale
            p = p.masked_fill(~valid[:, None, :], float("-inf"))  # [tq, H, topk]
            lse = logsumexp(p, dim=-1)  # [tq, H]; -inf if no valid index
            prob = exp(p - torch.where(torch.isinf(lse) & (lse < 0), 0.0, lse)[..., None])
            outs.append(mm(prob, keys[..., :d_v]))
            lses.append(lse)
    if not outs:
        out, lse = q.new_zeros((t, h, d_v)), torch.full((t, h), float("-inf"))
    else:
        out, lse = torch.cat(outs).to(q.dtype), torch.cat(lses)
    return out, (lse if return_lse else None)


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq like q, dkv like kv_cache) from the forward's lse and (d_out, d_lse or None)."""
    q, kv_cache, indices, layout = args["q"], args["kv_cache"], args["indices"], args["layout"]
    sm_scale, d_v = args["sm_scale"], args["d_v"]
    (_, lse), (d_out, d_lse) = outputs, grad_outputs
    t, h, d_qk = q.shape
    n_idx = indices.shape[1]
    dq = torch.zeros(t, h, d_qk)
    dflat = torch.zeros(kv_cache.numel() // d_qk, d_qk)
    d_out = torch.zeros(t, h, d_v) if d_out is None else d_out.float()
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        step = max(1, _GATHER_ELEMS // max(1, n_idx * d_qk))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            idx = indices[a:z].to(torch.int64)
            valid = (idx >= 0) & (idx < s)
            rows, keys = keys_at(kv_cache, layout, b, idx, valid)  # [n valid], [tq, topk, d_qk] fp32
            qa = q[a:z].float()
            p = torch.einsum("thd,tkd->thk", qa, keys) * sm_scale
            shift = torch.where(torch.isneginf(lse[a:z]), 0.0, lse[a:z])[..., None]
            p = torch.exp(p - shift).masked_fill(~valid[:, None, :], 0.0)  # softmax [tq, H, topk]
            dp = torch.einsum("thd,tkd->thk", d_out[a:z], keys[..., :d_v])
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            if d_lse is not None:
                ds = ds + p * d_lse[a:z].float()[..., None]
            dq[a:z] = torch.einsum("thk,tkd->thd", ds, keys) * sm_scale
            dk = torch.einsum("thk,thd->tkd", ds, qa) * sm_scale
            dk[..., :d_v] += torch.einsum("thk,thd->tkd", p, d_out[a:z])
            dflat.index_add_(0, rows, dk[valid])
    return dq.to(q.dtype), dflat.view(kv_cache.shape).to(kv_cache.dtype)


IMPL = by_kind(
    OpImpl(
        sparse_mla_attention,
        OpCaps(FLOATS, ("ragged", "paged", "pools"), differentiable=True, layout_invariant=True),
        backward=backward,
        backward_forces={"return_lse": True},
    ),
    dict.fromkeys(FP8_KINDS, FP8_ATTENTION),  # FlashMLA's 656-byte rows (SPEC 7.8)
)
