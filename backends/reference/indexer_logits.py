"""Lightning-indexer logits (SPEC 2.1).

    logits[t, j] = sum_h weights[t, h] * relu(dot(q[t, h], key_j))   causal j; else -inf

fp32 accumulation whatever the input dtype; ReLU before the (possibly negative) head weights.
Differentiable in q, k_cache (ragged) and weights.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.layout import SeqLayout
from backends.ops import FLOATS
from backends.reference._cache import causal_counts, keys_of_request

# Bound the [tq, H_I, S] fp32 intermediate (elements).
_BLOCK_ELEMS = 1 << 25


def score_block(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [tq, H_I, D_I], keys [s, D_I], weights [tq, H_I] -> [tq, s] fp32, no mask."""
    dots = torch.einsum("thd,sd->ths", q.float(), keys.float())  # [tq, H_I, s]
    return torch.einsum("ths,th->ts", torch.relu(dots), weights.float())


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


IMPL = OpImpl(indexer_logits, OpCaps(FLOATS, ("ragged", "paged"), differentiable=True))
