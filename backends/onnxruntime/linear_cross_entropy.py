"""onnxruntime backend: linear_cross_entropy -> glm5.linear_cross_entropy (functions/linear_cross_entropy.py).

Forward only (ORT inference): the loss for evaluation; training needs a backend with a backward.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import inference_only, run

#: logits per row chunk (a static attribute of the function), as the reference's bound
CHUNK_ELEMS = 1 << 24


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [N, D] float; weight: [V, D] float; targets: int64/int32 [N] -> (fp32 scalar mean loss,
    lse fp32 [N]). Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)"""
    loss, lse = run(
        "linear_cross_entropy",
        "linear_cross_entropy",
        {"h": h, "weight": weight, "targets": targets},
        [("loss", torch.float32, 0), ("lse", torch.float32, 1)],
        ignore_index=ignore_index,
        chunk_elems=CHUNK_ELEMS,
    )
    return loss, lse


IMPL = OpImpl(linear_cross_entropy, OpCaps(FLOATS, check=inference_only("h", "weight")))
