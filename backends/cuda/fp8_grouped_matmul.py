"""cuda backend: fp8_grouped_matmul (SPEC 7.3) -> kernels_cuda.fp8_gemm (all experts in one launch, the
M-tile schedule of kernels_cuda.grouped_matmul; per-128 K promotion as fp8_block_matmul)."""

from __future__ import annotations

import torch

from backends.caps import OpImpl
from backends.cuda.fp8_common import GEMM_CAPS
from kernels_cuda.fp8_gemm import fp8_grouped_matmul as _kernel


def fp8_grouped_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Rows of expert e times w_q[e]^T, block-scaled. Semantics: backends/reference/fp8_grouped_matmul.py"""
    return _kernel(x_q, x_scale, w_q, w_scale_inv, group_offsets, out_dtype)


IMPL = OpImpl(fp8_grouped_matmul, GEMM_CAPS)
