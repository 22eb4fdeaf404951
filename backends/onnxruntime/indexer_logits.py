"""onnxruntime backend: indexer_logits -> glm5.indexer_logits_{ragged,paged} (functions/indexer_logits.py).

The graph consumes the SeqLayout tensors directly and computes physical rows in-graph.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.layout import SeqLayout
from backends.onnxruntime._session import inference_only, layout_inputs, run


def indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """q: [T, H_I, D_I] float; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I]; weights: [T, H_I] fp32
    -> [T, max(seqlens_k)] fp32. Semantics: backends/reference/indexer_logits.py (SPEC 2.1)"""
    kind, lay = layout_inputs(layout, "k_cache", k_cache)
    inputs = {"q": q, "k_cache": lay.pop("k_cache"), "weights": weights, **lay}
    (out,) = run("indexer_logits", f"indexer_logits_{kind}", inputs, [("logits", torch.float32, 2)])
    return out


IMPL = OpImpl(
    indexer_logits, OpCaps(FLOATS, ("ragged", "paged"), check=inference_only("q", "k_cache", "weights"))
)
