"""MoE grouped GEMM over expert-sorted rows (SPEC 2.8).

    out[group_offsets[e] : group_offsets[e+1]] = x[same rows] @ w[e]^T     for every expert e

Each row depends only on itself and its expert's weight, so token order inside an expert and empty
experts change nothing. Quantized variants are the per-row W8A8 / W4A8 GEMMs of SPEC 2.6 / 2.7.

The float variant is differentiable in x and w (`backward`): with dy the output gradient,

    dx[rows of e] = dy[rows of e] @ w[e]        dw[e] = dy[rows of e]^T @ x[rows of e]

(an expert with no rows gets a zero dw[e]; rows outside every expert a zero dx). The quantized
variants are not differentiable (their integer x and w carry no gradient).
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import (
    FLOAT_DTYPES,
    check_epilogue,
    check_group_size,
    check_same_device,
    check_tensor,
    fail,
    unchecked_offsets,
)
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.invariant import engine as invariant
from backends.reference._common import FLOATS, dim, dtype_name, int8, randn, rows_by_cols, scalar
from backends.reference.w4a8_matmul import w4a8_matmul
from backends.reference.w8a8_matmul import w8a8_matmul


@reference_op("grouped_matmul")
def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows group_offsets[e]:group_offsets[e+1] of x [M, K] times w[e]^T ([E, N, K]) -> [M, N]."""
    m, n = x.shape[0], w.shape[1]  # x: [M, K], w: [E, N, K(/2)]
    out_dtype = out_dtype or x.dtype
    out = torch.zeros(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        r = slice(offs[e], offs[e + 1])
        if offs[e] == offs[e + 1]:
            continue
        if x.dtype.is_floating_point and invariant.active():
            out[r] = invariant.exact_matmul(x[r], w[e].T, out_dtype)
        elif x.dtype.is_floating_point:
            # fp64 so that a row does not depend on how many rows share its expert (an fp32 BLAS GEMM
            # blocks by M, which changes the low bits: the contract says token order changes no row)
            out[r] = (x[r].double() @ w[e].double().T).to(out_dtype)
        elif w.dtype == torch.int8:
            out[r] = w8a8_matmul(x[r], x_scale[r], w[e], w_scale[e], out_dtype=out_dtype)
        else:
            out[r] = w4a8_matmul(x[r], x_scale[r], w[e], w_scale[e], group_size, out_dtype=out_dtype)
    return out


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) like (x, w) of the float variant from the output gradient (no saved output); fp64 sums,
    as the forward's."""
    x, w, offs = args["x"], args["w"], args["group_offsets"].tolist()
    (grad,) = grad_outputs
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for e in range(w.shape[0]):
        r = slice(offs[e], offs[e + 1])
        if offs[e] == offs[e + 1]:
            continue
        dy = grad[r].double()
        dx[r] = dy @ w[e].double()
        dw[e] = dy.T @ x[r].double()
    return dx.to(x.dtype), dw.to(w.dtype)


# -- the declaration ---------------------------------------------------------------------------------
def check(x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None) -> str:
    """Returns the variant: "float", "w8a8" or "w4a8" (chosen by the dtypes of x and w)."""
    check_tensor("x", x, dtype=FLOAT_DTYPES + (torch.int8,), ndim=2)
    m, k = x.shape
    check_tensor("w", w, ndim=3)
    e = w.shape[0]
    check_tensor("group_offsets", group_offsets, dtype=(torch.int32, torch.int64), shape=(e + 1,))
    check_same_device(x=x, w=w, group_offsets=group_offsets)
    if x.dtype in FLOAT_DTYPES:
        if w.dtype != x.dtype:
            fail("w", f"dtype {x.dtype} (as x)", w.dtype)
        if w.shape[2] != k:
            fail("w", f"shape [E, N, K={k}]", f"shape {list(w.shape)}")
        for name, v in (("x_scale", x_scale), ("w_scale", w_scale), ("group_size", group_size)):
            if v is not None:
                fail(name, "None for floating-point x", type(v).__name__)
        if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
            fail("out_dtype", "None or a float dtype", out_dtype)
        return "float"
    n = w.shape[1]
    if out_dtype is None:
        fail("out_dtype", "a float dtype for int8 x", None)
    if w.dtype == torch.int8:
        if w.shape[2] != k:
            fail("w", f"shape [E, N, K={k}]", f"shape {list(w.shape)}")
        if group_size is not None:
            fail("group_size", "None for W8A8 (per-channel scales)", group_size)
        check_epilogue(m, n, x_scale, (e, n), w_scale, None, out_dtype, x=x)
        return "w8a8"
    if w.dtype == torch.uint8:
        if k % 2 or w.shape[2] != k // 2:
            fail("w", f"packed int4 shape [E, N, K//2={k // 2}] with even K", f"shape {list(w.shape)}")
        check_group_size(k, group_size)
        check_epilogue(m, n, x_scale, (e, n, k // group_size), w_scale, None, out_dtype, x=x)
        return "w4a8"
    fail("w", "dtype int8 (W8A8) or uint8 (packed int4, W4A8) for int8 x", w.dtype)


def values(x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None) -> None:
    m = x.shape[0]
    offs = group_offsets.tolist()
    if offs[0] != 0 or offs[-1] > m or any(b < a for a, b in zip(offs, offs[1:])):
        fail(
            "group_offsets",
            f"non-decreasing offsets from 0 to at most M={m}",
            offs if len(offs) <= 16 else f"[{offs[0]}, ..., {offs[-1]}] (length {len(offs)})",
        )


def dtype(a: dict) -> str:
    """The dtype-axis value: the float dtype of x, or the quantized variant."""
    if a["x"].dtype == torch.int8:
        return "w8a8" if a["w"].dtype == torch.int8 else "w4a8"
    return dtype_name(a["x"].dtype)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        x=randn(g, 9, 32, dtype=dt, grad=grad),
        w=randn(g, 3, 16, 32, dtype=dt, grad=grad),
        group_offsets=torch.tensor([0, 4, 4, 9]),
        x_scale=None,
        w_scale=None,
        group_size=None,
        out_dtype=None,
    )


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments of variant `dt` with `quantity` ("K", "experts" or "group_size") at v."""
    gs = v if quantity == "group_size" else 32
    k, n, e = (v if quantity == "K" else 2 * gs), 8, (v if quantity == "experts" else 3)
    offs = torch.linspace(0, 6, e + 1).round().to(torch.int64)
    if dt in ("w8a8", "w4a8"):
        x_scale = torch.rand(6, generator=g)  # drawn first: the limit cases' inputs as they always were
        if dt == "w8a8":
            x, w = int8(g, 6, k), int8(g, e, n, k)
            w_scale, gs = torch.rand(e, n, generator=g), None
        else:
            k += k % 2
            gs = gs if k % gs == 0 else k
            x, w = int8(g, 6, k), torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
            w_scale = torch.rand(e, n, k // gs, generator=g)
        return dict(
            x=x,
            w=w,
            group_offsets=offs,
            x_scale=x_scale,
            w_scale=w_scale,
            group_size=gs,
            out_dtype=torch.bfloat16,
        )
    x, w = randn(g, 6, k, dtype=dt), randn(g, e, n, k, dtype=dt)
    return dict(x=x, w=w, group_offsets=offs, x_scale=None, w_scale=None, group_size=None, out_dtype=None)


DECL = OpDecl(
    name="grouped_matmul",
    spec_section="2.8",
    signature=grouped_matmul,
    dtype_axis=FLOATS + ("w8a8", "w4a8"),
    dtype_of=dtype,
    validate=check,
    values=values,
    unchecked=unchecked_offsets("x"),
    fake=rows_by_cols(("x", 0), ("w", 1), lambda a: a["out_dtype"] or a["x"].dtype),
    sample=sample,
    sized=sized,
    sharding="experts or intermediate local",
    grad_args=("x", "w"),  # the float variant (integer tensors carry no gradient)
    quantities={"K": dim("x", 1), "experts": dim("w", 0), "group_size": scalar("group_size")},
)
IMPL = OpImpl(
    grouped_matmul,
    OpCaps(FLOATS + ("w8a8", "w4a8"), differentiable=True, layout_invariant=True),
    backward=backward,
)
