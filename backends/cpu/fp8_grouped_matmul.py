"""cpu backend: fp8_grouped_matmul (SPEC 7.3): fp8_block_matmul's exact core per non-empty expert on its
rows (bit for bit the reference, which computes each expert the same way); empty experts cost nothing.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._fp8 import block_matmul_into


def fp8_grouped_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Rows of expert e times w_q[e]^T, block-scaled. Semantics: backends/reference/fp8_grouped_matmul.py"""
    m, n = x_q.shape[0], w_q.shape[1]
    out = torch.zeros(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    for e in range(w_q.shape[0]):
        r0, r1 = offs[e], offs[e + 1]
        if r0 == r1:
            continue
        acc = torch.zeros(r1 - r0, n, dtype=torch.float32)
        block_matmul_into(acc, x_q[r0:r1], x_scale[r0:r1], w_q[e], w_scale_inv[e])
        out[r0:r1] = acc.to(out_dtype)
    return out


IMPL = OpImpl(
    fp8_grouped_matmul,
    OpCaps(FLOATS, notes={"accumulation": "fp8_block_matmul's exact core per expert (bitwise)"}),
)
