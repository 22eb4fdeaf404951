"""onnxruntime backend: sparse_mla_attention -> glm5.sparse_mla_attention_{ragged,paged}
(functions/sparse_mla_attention.py). Forward only: ONNX Runtime inference has no autograd."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.layout import SeqLayout
from backends.onnxruntime._session import inference_only, layout_inputs, run


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, H, d_qk] float; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk];
    indices: int32 [T, topk] -> (out [T, H, d_v] dtype of q, lse [T, H] fp32).
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)"""
    kind, lay = layout_inputs(layout, "kv_cache", kv_cache)
    inputs = {"q": q, "kv_cache": lay.pop("kv_cache"), "indices": indices, **lay}
    out, lse = run(
        "sparse_mla_attention",
        f"sparse_mla_attention_{kind}",
        inputs,
        [("out", q.dtype, 3), ("lse", torch.float32, 2)],
        sm_scale=float(sm_scale),
        d_v=d_v,
    )
    return out, (lse if return_lse else None)


IMPL = OpImpl(
    sparse_mla_attention, OpCaps(FLOATS, ("ragged", "paged"), check=inference_only("q", "kv_cache"))
)
