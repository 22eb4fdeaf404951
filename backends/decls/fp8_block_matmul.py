"""fp8_block_matmul (SPEC 7.2): block-scaled FP8 GEMM, DeepSeek-V3 scaling."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls._common import FLOATS, TDTYPE, dtype_of, randn, rows_by_cols


def fp8_block_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale_inv: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3 [N, K], w_scale_inv fp32
    [ceil(N/128), ceil(K/128)] -> [M, N] out_dtype."""


def quantized_rows(g: torch.Generator) -> tuple[Tensor, Tensor]:
    from backends.reference.fp8_quant_group import fp8_quant_group as quant

    return quant(randn(g, 3, 130), 128, 1e-4, True)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    from backends.reference.fp8_format import quantize_weight_blocks

    x_q, x_s = quantized_rows(g)
    w_q, w_s = quantize_weight_blocks(randn(g, 5, 130))
    return dict(x_q=x_q, x_scale=x_s, w_q=w_q, w_scale_inv=w_s, bias=None, out_dtype=TDTYPE[dt])


DECL = OpDecl(
    name="fp8_block_matmul",
    spec_section="7.2",
    signature=fp8_block_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=v8.check_fp8_block_matmul,
    fake=rows_by_cols(("x_q", 0), ("w_q", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sharding="columns or rows local",
)
