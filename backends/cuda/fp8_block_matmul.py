"""cuda backend: fp8_block_matmul (SPEC 7.2) -> kernels_cuda.fp8_gemm (one e4m3 tl.dot per 128-wide K block,
promoted into an fp32 accumulator with both block scales; sm_89+ or the interpreter)."""

from __future__ import annotations

import torch

from backends.caps import OpImpl
from backends.cuda.fp8_common import GEMM_CAPS
from kernels_cuda.fp8_gemm import fp8_block_matmul as _kernel


def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q e4m3 [M, K], x_scale [M, ceil(K/128)], w_q e4m3 [N, K], w_scale_inv [ceil(N/128), ceil(K/128)].
    Semantics: backends/reference/fp8_block_matmul.py (SPEC 7.2)"""
    return _kernel(x_q, x_scale, w_q, w_scale_inv, None if bias is None else bias.contiguous(), out_dtype)


IMPL = OpImpl(fp8_block_matmul, GEMM_CAPS)
