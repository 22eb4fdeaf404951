"""onnxruntime backend: indexer_topk -> glm5.indexer_topk_{ragged,paged} (functions/indexer_topk.py).

Keys are scored KEY_CHUNK at a time inside an ONNX Loop and merged into a running top-k with the
SPEC 2.3 rank key, so the tie rule holds bitwise and the [T, S] logits are never materialised.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.layout import SeqLayout
from backends.onnxruntime._session import layout_inputs, run

#: keys scored per Loop step (a static attribute of the function; part of the session cache key)
KEY_CHUNK = 2048


def indexer_topk(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout, topk: int
) -> torch.Tensor:
    """Inputs as indexer_logits -> int32 [T, topk] logical positions, -1 past the causal keys.
    Semantics: backends/reference/indexer_topk.py (SPEC 2.2)"""
    kind, lay = layout_inputs(layout, "k_cache", k_cache)
    inputs = {"q": q, "k_cache": lay.pop("k_cache"), "weights": weights, **lay}
    (out,) = run(
        "indexer_topk",
        f"indexer_topk_{kind}",
        inputs,
        [("indices", torch.int32, 2)],
        topk=topk,
        chunk=KEY_CHUNK,
    )
    return out


IMPL = OpImpl(
    indexer_topk, OpCaps(FLOATS, ("ragged", "paged"), tie_rule="lower_index", notes={"key_chunk": KEY_CHUNK})
)
