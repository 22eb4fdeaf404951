"""onnxruntime backend: topk -> glm5.topk / glm5.topk_lengths (functions/topk.py).

ORT's TopK breaks ties by the lower index (checked up to 300k columns) but ranks NaN first; the
function ranks on a float64 key that puts NaN last, so SPEC 2.3 holds bitwise: tie_rule lower_index.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import run


def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] float; lengths: int32/int64 [R] or None -> (values [R, k] dtype of x, indices int32 [R, k]).
    Semantics: backends/reference/topk.py (SPEC 2.3)"""
    outs = [("values", x.dtype, 2), ("indices", torch.int32, 2)]
    if lengths is None:
        values, indices = run("topk", "topk", {"x": x}, outs, k=k)
    else:
        values, indices = run("topk", "topk_lengths", {"x": x, "lengths": lengths}, outs, k=k)
    return values, indices


IMPL = OpImpl(topk, OpCaps(FLOATS, tie_rule="lower_index"))
