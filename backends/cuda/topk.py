"""cuda backend: topk (SPEC 2.3) -> kernels_cuda.topk, a deterministic threshold-select kernel.

Claims the lower-index tie rule bitwise: the selected set and order are a function of the values only
(counts, in-order cumulative sums and a sort of unique (value, index) composites; no atomics). A row's
result is a function of that row alone (the rows sharing a program keep their own buffers), so it is the
same in the layout-invariant mode (SPEC 12), which it therefore declares.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from kernels_cuda.topk import MAX_K
from kernels_cuda.topk import topk as _kernel

LIMITS = (
    Limit("k", max=MAX_K, reason="the final sort keeps k (value, index) pairs in one program"),
    Limit("columns", max=2**31 - 2, reason="column indices are int32"),
)


def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] float; lengths: [R] int32/int64 or None. Returns (values [R, k], indices int32 [R, k]).
    Semantics: backends/reference/topk.py (SPEC 2.3)
    """
    return _kernel(x, k, lengths)


IMPL = OpImpl(
    topk,
    OpCaps(
        FLOATS,
        limits=LIMITS,
        run_to_run=True,
        batch_invariant=True,
        tie_rule="lower_index",
        layout_invariant=True,  # comparisons only
    ),
)
