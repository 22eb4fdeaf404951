"""cpu backend: indexer_logits (SPEC 2.1): per request, one GEMM of all heads' queries against the keys,
ReLU in place, then the head-weighted sum as a batched GEMV. The backward is the reference's (declared as
this op's `OpImpl.backward`: fp32 torch, from the output gradient).
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._cache import causal_counts, keys_of_request
from backends.layout import SeqLayout
from backends.reference.indexer_logits import backward as reference_backward

# Bound the [tq, H_I, S] fp32 intermediate (elements): 16 MiB keeps it near the caches.
BLOCK_ELEMS = 1 << 22


def scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [tq, H_I, D_I] fp32, keys [s, D_I] fp32, weights [tq, H_I] fp32 -> [tq, s] fp32, no mask."""
    tq, h, d = q.shape
    dots = torch.mm(q.reshape(tq * h, d), keys.T).view(tq, h, -1).relu_()
    return torch.bmm(weights[:, None, :], dots)[:, 0]


def indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """q: [T, H_I, D_I]; k_cache ragged [rows, D_I] or paged [nb, bs, D_I]; weights: [T, H_I] float32.
    Returns [T, max(seqlens_k)] float32, -inf where the key is not causal for the query.
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
    """
    t, h_i, _ = q.shape
    bounds = layout.request_bounds()
    out = torch.full((t, max((s for _, _, s in bounds), default=0)), float("-inf"), dtype=torch.float32)
    qf, wf = q.float(), weights.float()
    for b, (q0, q1, s) in enumerate(bounds):
        if q1 == q0 or s == 0:
            continue
        keys = keys_of_request(k_cache, layout, b, s).float()
        visible = causal_counts(q1 - q0, s)
        step = max(1, BLOCK_ELEMS // (h_i * s))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            causal = torch.arange(s)[None, :] < visible[a - q0 : z - q0, None]
            out[a:z, :s] = scores(qf[a:z], keys, wf[a:z]).masked_fill_(~causal, float("-inf"))
    return out


IMPL = OpImpl(
    indexer_logits,
    OpCaps(FLOATS, ("ragged", "paged"), run_to_run=True, batch_invariant=True, differentiable=True),
    backward=reference_backward,
)
