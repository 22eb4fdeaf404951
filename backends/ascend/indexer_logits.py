"""ascend backend: indexer_logits (SPEC 2.1) -> kernels_ascend.indexer_logits.

npu_lightning_indexer returns top-k indices only (its `return_value` is documented for non-PA layouts and
still only the selected scores), so the full logits come from the triton-ascend kernel. The adapter turns
the SeqLayout into physical key rows per request and a causal key count per token.
Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.layout import SeqLayout

HEADS_REASON = "the kernel holds all heads of a token in one tile"
# query tokens per kernel launch in the top-k fallback: bounds its [rows, S] fp32 scores
ROW_BLOCK = 64


def kernel_logits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    layout: SeqLayout,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel scores of `tokens` (int64 [n], default all): ([n, max seqlen_k] fp32, visible int32 [n])."""
    from kernels_ascend.indexer_logits import indexer_logits as kernel

    rows, start = ad.physical_rows(layout, k_cache)  # [sum S_b], [B]
    t_req = ad.token_request(layout)
    visible = ad.causal_visible(layout)
    if tokens is not None:
        q, weights, t_req, visible = q[tokens], weights[tokens], t_req[tokens], visible[tokens]
    logits = kernel(
        q,
        weights,
        k_cache.reshape(-1, k_cache.shape[-1]),
        rows.to(torch.int32),
        start[t_req].to(torch.int32).contiguous(),
        visible.contiguous(),
        layout.seqlen_k_max(),
    )
    return logits, visible


def impl(provider: OpsProvider) -> OpImpl:
    def indexer_logits(q, k_cache, weights, layout):
        provider.record("indexer_logits", provider.kernel_label("indexer_logits"))
        return kernel_logits(q, k_cache, weights, layout)[0]

    return OpImpl(
        indexer_logits,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            limits=(
                Limit("index_heads", max=64, reason="the kernel holds all heads of a token in one tile"),
            ),
        ),
    )
