"""fp8_grouped_matmul (SPEC 7.3): the MoE FP8 GEMM over expert-sorted rows, block scales as 7.2."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls._common import FLOATS, TDTYPE, dtype_of, randn, rows_by_cols
from backends.decls.fp8_block_matmul import quantized_rows


def fp8_grouped_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale_inv: Tensor,
    group_offsets: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """w_q e4m3 [E, N, K], w_scale_inv fp32 [E, ceil(N/128), ceil(K/128)], group_offsets int [E+1]."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    from backends.reference.fp8_format import quantize_weight_blocks

    x_q, x_s = quantized_rows(g)
    w_q, w_s = quantize_weight_blocks(randn(g, 2, 5, 130))
    offs = torch.tensor([0, 1, 3], dtype=torch.int32)
    return dict(x_q=x_q, x_scale=x_s, w_q=w_q, w_scale_inv=w_s, group_offsets=offs, out_dtype=TDTYPE[dt])


DECL = OpDecl(
    name="fp8_grouped_matmul",
    spec_section="7.3",
    signature=fp8_grouped_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=v8.check_fp8_grouped_matmul,
    values=v8.values_fp8_grouped_matmul,
    fake=rows_by_cols(("x_q", 0), ("w_q", 1), lambda a: a["out_dtype"]),
    sample=sample,
    sharding="experts or intermediate local",
    unchecked=v.unchecked_offsets("x_q"),
)
