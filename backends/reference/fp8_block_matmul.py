"""FP8 block-scaled GEMM (SPEC 7.2; DeepSeek `fp8_gemm`, DeepGEMM `fp8_gemm_nt`, vLLM
`w8a8_block_fp8_matmul`).

x_q e4m3 [M, K] with x_scale fp32 [M, ceil(K/128)] (1 x 128 groups); w_q e4m3 [N, K] with
w_scale_inv fp32 [ceil(N/128), ceil(K/128)] (128 x 128 blocks; a multiplier despite the name).
Partial last K / N blocks are legal (their scales cover the columns / rows that exist).

    d[m, n, kb] = sum_{k in block kb} x_q[m, k] * w_q[n, k]                   exact, rounded once to fp32
    acc[m, n]   = sum_kb  (d[m, n, kb] * x_scale[m, kb]) * w_scale_inv[n // 128, kb]    fp32, kb ascending
    out[m, n]   = (acc[m, n] + bias[n]).to(out_dtype)

This is the "promotion every 128 K elements" of the DeepSeek-V3 report: the tensor core accumulates one
block, the fp32 accumulator takes it with both scales. A kernel's within-block sum may round
differently (fp32, or Hopper's ~14-bit wgmma accumulator); the tolerance is stated in SPEC 7.2.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_out_dtype, check_same_device, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import E4M3, FLOATS, TDTYPE, dtype_of, randn, rows_by_cols
from backends.reference.fp8_format import BLOCK, cdiv, quantize_weight_blocks


def block_dots(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] e4m3 -> [KB, M, N] fp32 per-block dot products. Products of two e4m3 values
    have <= 8 significant bits within 2**-18 .. 2**18, so a 128-term fp64 sum is exact."""
    k = x_q.shape[1]
    out = []
    for kb in range(cdiv(k, BLOCK)):
        c = slice(kb * BLOCK, min((kb + 1) * BLOCK, k))
        out.append((x_q[:, c].double() @ w_q[:, c].double().T).float())
    if not out:
        return torch.zeros(0, x_q.shape[0], w_q.shape[0])
    return torch.stack(out)


def promote(d: torch.Tensor, x_scale: torch.Tensor, w_scale_row: torch.Tensor) -> torch.Tensor:
    """d [KB, M, N], x_scale [M, KB], w_scale_row [N, KB] (each column's block scales) -> fp32 [M, N]."""
    acc = torch.zeros(d.shape[1:], dtype=torch.float32)
    for kb in range(d.shape[0]):
        acc = acc + (d[kb] * x_scale[:, kb, None]) * w_scale_row[None, :, kb]
    return acc


@reference_op("fp8_block_matmul")
def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    n = w_q.shape[0]  # w_q: [N, K]
    w_rows = w_scale_inv.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, KB]
    acc = promote(block_dots(x_q, w_q), x_scale.float(), w_rows)
    if bias is not None:
        acc = acc + bias.float()[None, :]
    return acc.to(out_dtype)


def check(x_q, x_scale, w_q, w_scale_inv, bias, out_dtype) -> None:
    check_tensor("x_q", x_q, dtype=E4M3, ndim=2)
    m, k = x_q.shape
    check_tensor("w_q", w_q, dtype=E4M3, ndim=2)
    if w_q.shape[1] != k:
        fail("w_q", f"shape [N, K={k}] (K as x_q)", f"shape {list(w_q.shape)}")
    n = w_q.shape[0]
    check_tensor("x_scale", x_scale, dtype=torch.float32, shape=(m, cdiv(k, BLOCK)))
    check_tensor("w_scale_inv", w_scale_inv, dtype=torch.float32, shape=(cdiv(n, BLOCK), cdiv(k, BLOCK)))
    if bias is not None:
        check_tensor("bias", bias, dtype=FLOAT_DTYPES, shape=(n,))
    check_out_dtype(out_dtype)
    check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale_inv=w_scale_inv, bias=bias)


def quantized_rows(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 130 quantized by fp8_quant_group (UE8M0 scales): a sample's activations."""
    from backends.reference.fp8_quant_group import fp8_quant_group as quant

    return quant(randn(g, 3, 130), 128, 1e-4, True)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    x_q, x_s = quantized_rows(g)
    w_q, w_s = quantize_weight_blocks(randn(g, 5, 130))
    return dict(x_q=x_q, x_scale=x_s, w_q=w_q, w_scale_inv=w_s, bias=None, out_dtype=TDTYPE[dt])


DECL = OpDecl(
    name="fp8_block_matmul",
    spec_section="7.2",
    signature=fp8_block_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=check,
    fake=rows_by_cols(("x_q", 0), ("w_q", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sharding="columns or rows local",
)
IMPL = OpImpl(fp8_block_matmul, OpCaps(FLOATS))
