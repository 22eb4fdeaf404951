"""ascend backend: topk (SPEC 2.3) -> kernels_ascend.topk (no fused torch_npu operator has a tie rule).

The kernel selects and orders by the rule's total order, so SPEC 2.3 holds bitwise (tie_rule="lower_index").
Semantics: backends/reference/topk.py (SPEC 2.3)
"""

from __future__ import annotations

import torch

from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS

PROVENANCE = "kernels_ascend.topk"


def impl(provider: OpsProvider) -> OpImpl:
    def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None):
        from kernels_ascend.topk import topk as kernel

        provider.record("topk", provider.kernel_label("topk"))
        return kernel(x, k, lengths)

    return OpImpl(
        topk,
        OpCaps(
            FLOATS,
            tie_rule="lower_index",
            layout_invariant=True,  # comparisons only: each row's result is its own, in any mode
            notes={
                "cost": "per row 19 (bf16) to 35 (fp32) 1-D passes over C keys plus k^2 compares "
                "(no tl.sort on Ascend: a bitwise threshold search, then rank counting of the k kept)"
            },
        ),
    )
