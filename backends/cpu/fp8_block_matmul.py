"""cpu backend: fp8_block_matmul (SPEC 7.2), bit for bit the reference: every K block's dot product is
exact in fp64 (e4m3 products have <= 8 significant bits within 2**-18 .. 2**18), so one batched fp64 GEMM
per 128-column block computes all K blocks' dots at once; each is rounded to fp32, scaled by both block
scales and promoted into the fp32 accumulator in ascending block order, as the reference does.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._fp8 import block_matmul_into


def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3 [N, K], w_scale_inv fp32
    [ceil(N/128), ceil(K/128)] -> [M, N] out_dtype. Semantics: backends/reference/fp8_block_matmul.py"""
    acc = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.float32)
    block_matmul_into(acc, x_q, x_scale, w_q, w_scale_inv)
    if bias is not None:
        acc.add_(bias.float()[None, :])
    return acc.to(out_dtype)


IMPL = OpImpl(
    fp8_block_matmul,
    OpCaps(
        FLOATS,
        notes={"accumulation": "exact fp64 block dots, fp32 promotion in the reference's order (bitwise)"},
    ),
)
