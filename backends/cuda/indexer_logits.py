"""cuda backend: indexer_logits (SPEC 2.1) -> kernels_cuda.indexer_logits (ragged and paged caches; the
block-table lookup happens in the kernel). Forward only: inputs that require grad are declined. In the
layout-invariant mode (SPEC 12) the logits are `_indexer.exact_logits` (the reference's bits in the mode)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cuda import _indexer
from backends.invariant import engine as invariant
from backends.layout import SeqLayout
from kernels_cuda.indexer_logits import indexer_logits as _kernel


def indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """q: [T, H_I, D_I]; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I]; weights: [T, H_I] fp32.
    Returns [T, max(seqlens_k)] float32, -inf where not causal.
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
    """
    if invariant.active():
        out = torch.full((q.shape[0], layout.seqlen_k_max()), float("-inf"), device=q.device)
        for a, z, logits, _ in _indexer.exact_logits(q, k_cache, weights, layout):
            out[a:z] = logits
        return out
    return _kernel(q, k_cache, weights, s_max=layout.seqlen_k_max(), **_indexer.layout_args(layout))


IMPL = OpImpl(
    indexer_logits,
    OpCaps(
        FLOATS,
        ("ragged", "paged"),
        limits=_indexer.LIMITS,
        check=_indexer.check,
        run_to_run=True,
        batch_invariant=True,
        layout_invariant=True,
    ),
)
