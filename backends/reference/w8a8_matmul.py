"""W8A8 GEMM (SPEC 2.6).

    acc[m, n] = sum_k int32(x_q[m, k]) * int32(w_q[n, k])            exact
    out[m, n] = (float32(acc) * x_scale[m] * w_scale[n] + bias[n]).to(out_dtype)

The integer part is an fp64 matmul of integer-valued tensors: exact (|acc| <= 127*128*K < 2^53)
and far faster on CPUs without VNNI than torch._int_mm.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import check_epilogue, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import FLOATS, TDTYPE, dim, dtype_of, int8, randn, rows_by_cols


def int_matmul_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] x b [N, K]^T of integer tensors -> exact int64 [M, N]."""
    return (a.double() @ b.double().T).to(torch.int64)


def scale_epilogue(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = acc.float() * x_scale[:, None] * w_scale[None, :]  # fp32, in this order
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


@reference_op("w8a8_matmul")
def w8a8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q int8 [M, K], x_scale fp32 [M], w_q int8 [N, K], w_scale fp32 [N], bias [N] -> [M, N] out_dtype."""
    acc = int_matmul_exact(x_q, w_q)  # [M, N], exact
    return scale_epilogue(acc, x_scale, w_scale, bias, out_dtype)


def check(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> None:
    check_tensor("x_q", x_q, dtype=torch.int8, ndim=2)
    m, k = x_q.shape
    check_tensor("w_q", w_q, dtype=torch.int8, ndim=2)
    if w_q.shape[1] != k:
        fail("w_q", f"shape [N, K={k}] (K as x_q)", f"shape {list(w_q.shape)}")
    n = w_q.shape[0]
    check_epilogue(m, n, x_scale, (n,), w_scale, bias, out_dtype, x_q=x_q, w_q=w_q)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        x_q=int8(g, 5, 64),
        x_scale=randn(g, 5).abs(),
        w_q=int8(g, 7, 64),
        w_scale=randn(g, 7).abs(),
        bias=randn(g, 7),
        out_dtype=TDTYPE[dt],
    )


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with `quantity` ("K" or "N") at v."""
    k, n = (v if quantity == "K" else 64), (v if quantity == "N" else 8)
    return dict(
        x_q=int8(g, 3, k),
        x_scale=torch.rand(3, generator=g),
        w_q=int8(g, n, k),
        w_scale=torch.rand(n, generator=g),
        bias=None,
        out_dtype=TDTYPE.get(dt, torch.float32),
    )


DECL = OpDecl(
    name="w8a8_matmul",
    spec_section="2.6",
    signature=w8a8_matmul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("out_dtype"),
    validate=check,
    fake=rows_by_cols(("x_q", 0), ("w_q", 0), lambda a: a["out_dtype"]),
    sample=sample,
    sized=sized,
    sharding="columns or rows local",
    quantities={"K": dim("x_q", 1), "N": dim("w_q", 0)},
)
IMPL = OpImpl(w8a8_matmul, OpCaps(FLOATS))
