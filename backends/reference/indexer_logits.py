"""Lightning-indexer logits (SPEC 2.1).

    logits[t, j] = sum_h weights[t, h] * relu(dot(q[t, h], key_j))   causal j; else -inf

fp32 accumulation whatever the input dtype; ReLU before the (possibly negative) head weights.
Differentiable in q, k_cache and weights: `backward` (the op's declared backward), with g the output
gradient on causal keys, r = relu(dot(q[t, h], key_j)):
    dweights[t, h] = sum_j g[t, j] r,  dq[t, h] = sum_j g[t, j] w[t, h] [r > 0] key_j,
    dkey_j = sum_{t, h} g[t, j] w[t, h] [r > 0] q[t, h]   (fp32)
"""

from __future__ import annotations

import torch

from backends import invariant
from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.intra_op import one_thread
from backends.layout import SeqLayout
from backends.ops import FLOATS
from backends.reference._cache import causal_counts, keys_at, keys_of_request

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


IMPL = OpImpl(
    indexer_logits,
    OpCaps(FLOATS, ("ragged", "paged"), differentiable=True, layout_invariant=True),
    backward=backward,
)
