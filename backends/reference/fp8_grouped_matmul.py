"""FP8 block-scaled MoE GEMM over expert-sorted rows (SPEC 7.3; DeepGEMM
`m_grouped_fp8_gemm_nt_contiguous`, vLLM/SGLang fused MoE with `block_shape=[128, 128]`).

    out[group_offsets[e] : group_offsets[e+1]] = fp8_block_matmul(x_q[rows], x_scale[rows],
                                                                  w_q[e], w_scale_inv[e])

x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3 [E, N, K], w_scale_inv fp32
[E, ceil(N/128), ceil(K/128)]. Each row depends only on itself and its expert (empty experts legal);
DeepGEMM's contiguous layout additionally pads each segment to its M block, which the caller drops.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import cdiv, check_out_dtype, check_same_device, check_tensor, fail, unchecked_offsets
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import E4M3, FLOATS, TDTYPE, dtype_of, randn, rows_by_cols
from backends.reference.fp8_block_matmul import BLOCK, block_dots, promote, quantized_rows
from backends.reference.fp8_format import quantize_weight_blocks


@reference_op("fp8_grouped_matmul")
def fp8_grouped_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    m, n = x_q.shape[0], w_q.shape[1]  # x_q: [M, K], w_q: [E, N, K]
    out = torch.zeros(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    for e in range(w_q.shape[0]):
        if offs[e] == offs[e + 1]:
            continue
        r = slice(offs[e], offs[e + 1])
        w_rows = w_scale_inv[e].float().repeat_interleave(BLOCK, dim=0)[:n]
        out[r] = promote(block_dots(x_q[r], w_q[e]), x_scale[r].float(), w_rows).to(out_dtype)
    return out


def check(x_q, x_scale, w_q, w_scale_inv, group_offsets, out_dtype) -> None:
    check_tensor("x_q", x_q, dtype=E4M3, ndim=2)
    m, k = x_q.shape
    check_tensor("w_q", w_q, dtype=E4M3, ndim=3)
    e, n = w_q.shape[0], w_q.shape[1]
    if w_q.shape[2] != k:
        fail("w_q", f"shape [E, N, K={k}] (K as x_q)", f"shape {list(w_q.shape)}")
    check_tensor("x_scale", x_scale, dtype=torch.float32, shape=(m, cdiv(k, BLOCK)))
    check_tensor("w_scale_inv", w_scale_inv, dtype=torch.float32, shape=(e, cdiv(n, BLOCK), cdiv(k, BLOCK)))
    check_tensor("group_offsets", group_offsets, dtype=(torch.int32, torch.int64), shape=(e + 1,))
    check_out_dtype(out_dtype)
    check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale_inv=w_scale_inv, group_offsets=group_offsets)


def values(x_q, x_scale, w_q, w_scale_inv, group_offsets, out_dtype) -> None:
    m = x_q.shape[0]
    offs = group_offsets.tolist()
    if offs[0] != 0 or offs[-1] > m or any(b < a for a, b in zip(offs, offs[1:])):
        shown = offs if len(offs) <= 16 else f"[{offs[0]}, ..., {offs[-1]}] (length {len(offs)})"
        fail("group_offsets", f"non-decreasing offsets from 0 to at most M={m}", shown)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
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
    validate=check,
    values=values,
    unchecked=unchecked_offsets("x_q"),
    fake=rows_by_cols(("x_q", 0), ("w_q", 1), lambda a: a["out_dtype"]),
    sample=sample,
    sharding="experts or intermediate local",
)
IMPL = OpImpl(fp8_grouped_matmul, OpCaps(FLOATS))
