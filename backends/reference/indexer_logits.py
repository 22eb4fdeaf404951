"""Lightning-indexer logits (SPEC 2.1).

    logits[t, j] = sum_h weights[t, h] * relu(dot(q[t, h], key_j))   causal j; else -inf

fp32 accumulation whatever the input dtype; ReLU before the (possibly negative) head weights.
This module is the op's declaration too (`DECL`: the function below is the signature; validators,
fake, sized builder, sample).
Differentiable in q, k_cache and weights: `backward` (the op's declared backward), with g the output
gradient on causal keys, r = relu(dot(q[t, h], key_j)):
    dweights[t, h] = sum_j g[t, j] r,  dq[t, h] = sum_j g[t, j] w[t, h] [r > 0] key_j,
    dkey_j = sum_{t, h} g[t, j] w[t, h] [r > 0] q[t, h]   (fp32)
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_heads, check_same_device, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.intra_op import one_thread
from backends.invariant import engine as invariant
from backends.layout import SeqLayout, check_cache, check_layout
from backends.reference._cache import causal_counts, keys_at, keys_of_request
from backends.reference._common import FLOATS, LONG_BLOCKS, dim, dtype_of, long_layout, max_keys, randn
from backends.reference.fp8_format import INDEX_SCALE_BYTES

# Bound the [tq, H_I, S] fp32 intermediate (elements).
_BLOCK_ELEMS = 1 << 25


def score_block(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    dots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tq, H_I, D_I], keys [s, D_I], weights [tq, H_I] -> [tq, s] fp32, no mask.

    The one place these logits are computed on the CPU: every implementation that claims the reference's
    bits (the cpu backend's indexer top-k) calls this function on the same block shapes, because a BLAS
    sums in an order of its own that differs between CPUs (AVX2, AVX-512, AMX; Intel and AMD), call
    shapes and thread counts, so only the same call is the same sum; it runs on one intra-op thread, so
    the caller's thread count does not enter. `dots` [tq * H_I, s] and `out` [tq, 1, s] are optional
    preallocated buffers (same calls, same bits, fewer page faults).
    """
    tq, h, d = q.shape
    if invariant.active():  # exact products: the bits of any block, head count or CPU
        dots = invariant.exact_matmul(q.float().reshape(tq * h, d), keys.float().T).relu_()
        return invariant.weighted_sum(weights.float(), dots.view(tq, h, -1))
    with one_thread():
        dots = torch.mm(q.float().reshape(tq * h, d), keys.float().T, out=dots)  # [tq * H_I, s]
        dots.relu_()
        w = weights.float()[:, None, :]  # [tq, 1, H_I]
        return torch.bmm(w, dots.view(tq, h, -1), out=out)[:, 0]  # sum_h w[t, h] * relu(dot)


@reference_op("indexer_logits")
def indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """q [T, H_I, D_I] float, k_cache ragged [rows, D_I] / paged [nb, bs, D_I], weights fp32 [T, H_I]
    -> fp32 [T, max(seqlens_k)], -inf where not causal."""
    t, h_i, _ = q.shape  # q: [T, H_I, D_I]
    out = torch.full((t, layout.seqlen_k_max()), float("-inf"), dtype=torch.float32)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        keys = keys_of_request(k_cache, layout, b, s)  # [S_b, D_I]
        visible = causal_counts(q1 - q0, s)  # [T_b]
        step = max(1, _BLOCK_ELEMS // (h_i * s))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            scores = score_block(q[a:z], keys, weights[a:z])  # [tq, S_b]
            causal = torch.arange(s)[None, :] < visible[a - q0 : z - q0, None]
            out[a:z, :s] = scores.masked_fill(~causal, float("-inf"))
    return out


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, ...]:
    """(dq, dk_cache, dweights) like (q, k_cache, weights) from the output gradient (no saved output)."""
    q, k_cache, weights, layout = args["q"], args["k_cache"], args["weights"], args["layout"]
    (grad,) = grad_outputs
    t, h_i, d = q.shape
    dq = torch.zeros(t, h_i, d)
    dw = torch.zeros(t, h_i)
    dflat = torch.zeros(k_cache.numel() // d, d)
    qf, wf = q.float(), weights.float()
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        positions = torch.arange(s)
        rows, keys = keys_at(k_cache, layout, b, positions, torch.ones(s, dtype=torch.bool))  # [S_b, D_I]
        visible = causal_counts(q1 - q0, s)
        step = max(1, _BLOCK_ELEMS // (h_i * s))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            causal = positions[None, :] < visible[a - q0 : z - q0, None]
            g = grad[a:z, :s].float().masked_fill(~causal, 0.0)  # [tq, S_b]
            dots = torch.einsum("thd,sd->ths", qf[a:z], keys)
            dw[a:z] = torch.einsum("ts,ths->th", g, dots.clamp_min(0.0))
            d_dots = (g[:, None, :] * wf[a:z, :, None]).masked_fill(dots <= 0, 0.0)  # relu's gradient
            dq[a:z] = torch.einsum("ths,sd->thd", d_dots, keys)
            dflat.index_add_(0, rows, torch.einsum("ths,thd->sd", d_dots, qf[a:z]))
    return dq.to(q.dtype), dflat.view(k_cache.shape).to(k_cache.dtype), dw.to(weights.dtype)


def check(q, k_cache, weights, layout) -> None:
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    t, h_i, d_i = q.shape
    check_heads(q)
    check_tensor("k_cache", k_cache, ndim=(2, 3))
    fp8 = k_cache.dtype == torch.uint8  # the FP8 indexer cache: D_I e4m3 bytes + a scale per key
    if not fp8 and k_cache.dtype != q.dtype:
        fail("k_cache", f"dtype {q.dtype} (as q) or uint8 (FP8 rows)", k_cache.dtype)
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, h_i))
    check_same_device(q=q, k_cache=k_cache, weights=weights)
    check_layout(layout, t, k_cache, "k_cache")
    if fp8:
        check_cache("k_cache", k_cache, layout, d_i + INDEX_SCALE_BYTES, torch.uint8)
    else:
        check_cache("k_cache", k_cache, layout, d_i, q.dtype)


def values(q, k_cache, weights, layout) -> None:
    layout.check(q.shape[0], k_cache, "k_cache")


def fake(a: dict) -> torch.Tensor:
    s = a["layout"].max_seqlen_k
    s = torch.library.get_ctx().new_dynamic_size() if s is None else s
    return a["q"].new_empty((a["q"].shape[0], s), dtype=torch.float32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        q=randn(g, 4, 2, 16, dtype=dt, grad=grad),
        k_cache=randn(g, LONG_BLOCKS, 64, 16, dtype=dt, grad=grad),
        weights=randn(g, 4, 2, grad=grad),
        layout=long_layout(),
    )


KEYS = 2100  # > 2048: below it sparse selection equals dense and hides bugs


def sized(g: torch.Generator, dt: str, quantity: str, v: int, topk: int = 64) -> dict:
    """Arguments with `quantity` (a key of QUANTITIES) at v, keys more than topk (the indexer top-k's too)."""
    dt = dt if dt in FLOATS else "float32"
    h = v if quantity == "index_heads" else 2
    d = v if quantity == "index_head_dim" else 16
    keys = v if quantity == "keys" else max(KEYS, topk + 5)
    nb = -(-keys // 64)
    return dict(
        q=randn(g, 2, h, d, dtype=dt),
        k_cache=randn(g, nb, 64, d, dtype=dt),
        weights=torch.rand(2, h, generator=g),
        layout=SeqLayout.from_lengths([2], [keys], block_size=64),
    )


QUANTITIES = {"index_heads": dim("q", 1), "index_head_dim": dim("q", 2), "keys": max_keys}

DECL = OpDecl(
    name="indexer_logits",
    spec_section="2.1",
    signature=indexer_logits,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=fake,
    sample=sample,
    sized=sized,
    sharding="replicated",
    cache_arg="k_cache",
    grad_args=("q", "k_cache", "weights"),
    quantities=QUANTITIES,
)
IMPL = OpImpl(
    indexer_logits,
    OpCaps(FLOATS, ("ragged", "paged"), differentiable=True, layout_invariant=True),
    backward=backward,
)
