"""SwiGLU's activation on a fused gate-up projection (SPEC 2.10), forward and backward.

One program owns BLOCK_M rows x BLOCK_N columns of the output: it reads the gate and up tiles once,
computes in fp32 and writes once (the forward: out = g * sigmoid(g) * u; the backward: d gate and d up
side by side from x and dy, so the [M, 2N] input is read once more and nothing else is saved). sigmoid
is `1 / (1 + exp(-g))` with Triton's exp, so outputs agree with the reference to SPEC 4's default
tolerance and gradients to its gradient tolerance (SPEC 2.10).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, M, N, stride_xm, stride_xn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None] * stride_xm
    g = tl.load(x_ptr + rows + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + rows + (rn[None, :] + N) * stride_xn, mask=mask, other=0.0).to(tl.float32)
    out = g * _sigmoid(g) * u
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], out, mask=mask)


@triton.jit
def _silu_and_mul_backward_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    stride_dym,
    stride_dyn,
    stride_dxm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rm64 = rm.to(tl.int64)[:, None]
    g = tl.load(x_ptr + rm64 * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + rm64 * stride_xm + (rn[None, :] + N) * stride_xn, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rm64 * stride_dym + rn[None, :] * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    d_up = dy * g * s
    tl.store(dx_ptr + rm64 * stride_dxm + rn[None, :], d_gate, mask=mask)
    tl.store(dx_ptr + rm64 * stride_dxm + rn[None, :] + N, d_up, mask=mask)


def _grid(m: int, n: int) -> tuple[tuple[int, int], int, int]:
    # GPU: 4K-element tiles; interpreter: few, big programs (its cost is per operation, not per element)
    block_n = min(triton.next_power_of_2(max(n, 1)), 4096 if interpreter_active() else 1024)
    block_m = max(1, min((65536 if interpreter_active() else 4096) // block_n, triton.next_power_of_2(m)))
    return (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), block_m, block_n


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] float -> silu(x[:, :N]) * x[:, N:] [M, N], dtype of x.
    Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)"""
    m, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid, bm, bn = _grid(m, n)
    _silu_and_mul_kernel[grid](x, out, m, n, x.stride(0), x.stride(1), out.stride(0), BLOCK_M=bm, BLOCK_N=bn)
    count_launch("silu_and_mul")
    return out


def silu_and_mul_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx [M, 2N] (dtype of x) = [d gate | d up] from x and dy [M, N] (SPEC 2.10's formulas)."""
    m, n = x.shape[0], x.shape[1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return dx.zero_()
    grid, bm, bn = _grid(m, n)
    _silu_and_mul_backward_kernel[grid](
        x,
        dy,
        dx,
        m,
        n,
        x.stride(0),
        x.stride(1),
        dy.stride(0),
        dy.stride(1),
        dx.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
    )
    count_launch("silu_and_mul.backward")
    return dx
