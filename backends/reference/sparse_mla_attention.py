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
This module is the op's declaration too (`DECL`: the function below is the signature; validators, fake,
sized builder, sample).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.argcheck import FLOAT_DTYPES, _shape, check_int, check_same_device, check_tensor, fail
from backends.cache_layout import FP8_KINDS, MLAPools
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.invariant import engine as invariant
from backends.layout import SeqLayout, check_cache, check_layout
from backends.reference._cache import gather_rows, keys_at
from backends.reference._common import (
    FLOATS,
    LONG_BLOCKS,
    attention_fake,
    attention_returns,
    dim,
    dtype_of,
    long_layout,
    randn,
)
from backends.reference.fp8_format import MLA_D_QK, MLA_D_V, MLA_ROW_BYTES
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
    """q [T, H, d_qk], kv_cache ragged [rows, d_qk] / paged [nb, bs, d_qk], indices int32 [T, topk]
    -> (out [T, H, d_v] dtype of q, lse fp32 [T, H] or None)."""
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


def check_pools(pools: MLAPools, layout: SeqLayout, d_qk: int, dtype) -> None:
    """A split-pool latent cache (SPEC 2.4): latent [nb, bs, 1, c] and rope [nb, bs, 1, r], c + r = d_qk."""
    if layout.kind != "paged":
        fail("kv_cache", "one tensor [rows, D] for a ragged layout (split pools are paged)", "split pools")
    lat, rope = pools.latent, pools.rope
    check_tensor("kv_cache.latent", lat, dtype=dtype, ndim=4)
    check_tensor("kv_cache.rope", rope, dtype=dtype, ndim=4)
    nb, bs = lat.shape[:2]
    if lat.shape[2] != 1:
        fail("kv_cache.latent", "shape [num_blocks, block_size, 1, c] (one KV head)", f"shape {_shape(lat)}")
    if tuple(rope.shape[:3]) != (nb, bs, 1):
        fail("kv_cache.rope", f"shape [{nb}, {bs}, 1, r] (blocks as the latent)", f"shape {_shape(rope)}")
    if lat.shape[-1] + rope.shape[-1] != d_qk:
        fail("kv_cache", f"pool widths c + r == d_qk ({d_qk})", f"{lat.shape[-1]} + {rope.shape[-1]}")


def check(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True) -> None:
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    t, _, d_qk = q.shape
    pools = isinstance(kv_cache, MLAPools)
    fp8 = not pools and isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8
    if not pools:
        check_tensor("kv_cache", kv_cache, ndim=(2, 3))
        if not fp8 and kv_cache.dtype != q.dtype:
            fail("kv_cache", f"dtype {q.dtype} (as q) or uint8 (FP8 rows)", kv_cache.dtype)
    if fp8 and d_qk != MLA_D_QK:  # FlashMLA's 656-byte rows hold 512 latent + 64 RoPE
        fail("q", f"shape [T, H, {MLA_D_QK}] (a kv_cache of FP8 rows)", f"shape {_shape(q)}")
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != t:
        fail("indices", f"shape [T={t}, topk]", f"shape {_shape(indices)}")
    if pools:
        check_same_device(**{"q": q, "kv_cache.latent": kv_cache.latent, "kv_cache.rope": kv_cache.rope})
        check_same_device(q=q, indices=indices)
        check_layout(layout, t, kv_cache.latent, "kv_cache")
        check_pools(kv_cache, layout, d_qk, q.dtype)
    else:
        check_same_device(q=q, kv_cache=kv_cache, indices=indices)
        check_layout(layout, t, kv_cache, "kv_cache")
        width, dtype = (MLA_ROW_BYTES, torch.uint8) if fp8 else (d_qk, q.dtype)
        check_cache("kv_cache", kv_cache, layout, width, dtype)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not (sm_scale == sm_scale):
        fail("sm_scale", "a finite float", sm_scale)
    if abs(float(sm_scale)) == float("inf"):
        fail("sm_scale", "a finite float", sm_scale)
    check_int("d_v", d_v, min_value=1)
    if d_v > d_qk:
        fail("d_v", f"<= d_qk ({d_qk})", d_v)
    if fp8 and d_v != MLA_D_V:
        fail("d_v", f"{MLA_D_V} (the latent width of a kv_cache of FP8 rows)", d_v)
    if not isinstance(return_lse, bool):
        fail("return_lse", "a bool", type(return_lse).__name__)


def values(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True) -> None:
    layout.check(q.shape[0], kv_cache, "kv_cache")


def before_backward(run: Callable, args: dict, outputs: tuple, grads: tuple) -> tuple:
    """From the saved out and lse. The front door makes the forward return lse whenever a gradient will
    be taken (`OpImpl.backward_forces`); only a direct call with return_lse=False gets its lse here, from
    one more forward."""
    asked = args["return_lse"]
    args = {**args, "return_lse": True}
    if not (asked and outputs[1].numel()):
        outputs = run(args)
    return args, outputs, (grads[0], grads[1] if asked else None)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        q=randn(g, 4, 2, 40, dtype=dt, grad=grad),
        kv_cache=randn(g, LONG_BLOCKS, 64, 40, dtype=dt, grad=grad),
        indices=torch.randint(-1, 2100, (4, 64), generator=g, dtype=torch.int32),  # of 2100 keys
        layout=long_layout(),
        sm_scale=0.15,
        d_v=32,
        return_lse=True,
    )


KEYS = 2100  # > 2048: below it sparse attention equals dense and hides bugs


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with `quantity` (a key of QUANTITIES) at v, more keys than topk."""
    dt = dt if dt in FLOATS else "float32"
    h = v if quantity == "heads" else 2
    d_v = v if quantity == "d_v" else 32
    d_qk = v if quantity == "d_qk" else (d_v + v if quantity == "d_qk_minus_d_v" else max(d_v + 8, 40))
    d_v = min(d_v, d_qk)
    topk = v if quantity == "topk" else 2048
    keys = max(KEYS, topk + 5)
    lay = SeqLayout.from_lengths([2], [keys], block_size=64)
    idx = torch.randint(-1, keys, (2, topk), generator=g, dtype=torch.int32)
    kv = randn(g, -(-keys // 64), 64, d_qk, dtype=dt)
    return dict(
        q=randn(g, 2, h, d_qk, dtype=dt), kv_cache=kv, indices=idx, layout=lay, sm_scale=d_qk**-0.5, d_v=d_v
    )


QUANTITIES = {
    "heads": dim("q", 1),
    "d_qk": dim("q", 2),
    "d_v": lambda a: a["d_v"],
    "d_qk_minus_d_v": lambda a: a["q"].shape[2] - a["d_v"],
    "topk": dim("indices", 1),
}

DECL = OpDecl(
    name="sparse_mla_attention",
    spec_section="2.4",
    signature=sparse_mla_attention,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=attention_fake,
    sample=sample,
    sized=sized,
    sharding="heads local",
    cache_arg="kv_cache",
    grad_args=("q", "kv_cache"),
    saves_outputs=True,
    quantities=QUANTITIES,
    returns=attention_returns,
    before_backward=before_backward,
)
IMPL = by_kind(
    OpImpl(
        sparse_mla_attention,
        OpCaps(FLOATS, ("ragged", "paged", "pools"), differentiable=True, layout_invariant=True),
        backward=backward,
        backward_forces={"return_lse": True},
    ),
    dict.fromkeys(FP8_KINDS, FP8_ATTENTION),  # FlashMLA's 656-byte rows (SPEC 7.8)
)
