"""Kernels of the sequence-chunked linear + cross-entropy (SPEC 2.9); the chunk loop and autograd live in
backends/cuda/linear_cross_entropy.py. Three launchers, each over one chunk of n rows:

- `chunk_logits(h, weight)`: fp32 [n, V] = h @ weight^T, a tiled GEMM (kernels_cuda.grouped_matmul's
  `float_tile`: fp32 accumulation, IEEE fp32 products for fp32 inputs, never TF32), one program per
  BLOCK_M x BLOCK_N tile.
- `chunk_lse(logits, targets, ignore_index)`: one program per BLOCK_R rows streams V in BLOCK_V steps
  with an online max / rescaled sum (the FlashAttention recurrence) -> lse [n] and nll [n]
  (lse - logit[target], 0 for ignored rows). Differs from the reference's torch.logsumexp only in the
  order of the fp32 sum.
- `chunk_grad_(logits, targets, lse, scale, ignore_index)`: in place, logits become
  d loss / d logits = (exp(logit - lse) - onehot(target)) * scale for counted rows, 0 for ignored rows,
  the reference's operations in its order; `scale` is a 1-element device tensor (grad_loss / count), so
  nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda.grouped_matmul import float_tile


@triton.jit
def _logits_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    R,
    V,
    D,
    stride_hr,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_or,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < R
    mask_n = rn < V
    acc = float_tile(
        h_ptr,
        w_ptr,
        rm,
        rn,
        mask_m,
        mask_n,
        D,
        stride_hr,
        stride_hd,
        stride_wv,
        stride_wd,
        PRECISION,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    tl.store(out_ptr + rm[:, None] * stride_or + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lse_kernel(
    logits_ptr,
    tgt_ptr,
    lse_ptr,
    nll_ptr,
    R,
    V,
    stride_r,
    ignore_index,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rr < R
    row = logits_ptr + rr.to(tl.int64) * stride_r
    rv = tl.arange(0, BLOCK_V)
    run_max = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + rv
        x = tl.load(row[:, None] + vv[None, :], mask=mask_r[:, None] & (vv < V)[None, :], other=float("-inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        # a row with no finite logit yet (rows past R) shifts by 0, not -inf: no (-inf) - (-inf) NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        run_max = new_max
    lse = run_max + tl.log(tl.where(mask_r, run_sum, 1.0))
    tgt = tl.load(tgt_ptr + rr, mask=mask_r, other=ignore_index)
    counted = tgt != ignore_index
    x_t = tl.load(row + tl.where(counted, tgt, 0), mask=mask_r, other=0.0)
    tl.store(lse_ptr + rr, lse, mask=mask_r)
    tl.store(nll_ptr + rr, tl.where(counted, lse - x_t, 0.0), mask=mask_r)


@triton.jit
def _grad_kernel(
    logits_ptr,
    tgt_ptr,
    lse_ptr,
    scale_ptr,
    R,
    V,
    stride_r,
    ignore_index,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rr < R
    row = logits_ptr + rr.to(tl.int64) * stride_r
    tgt = tl.load(tgt_ptr + rr, mask=mask_r, other=ignore_index)
    lse = tl.load(lse_ptr + rr, mask=mask_r, other=0.0)
    coef = tl.where(tgt != ignore_index, tl.load(scale_ptr), 0.0)
    rv = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + rv
        mask = mask_r[:, None] & (vv < V)[None, :]
        p = tl.exp(tl.load(row[:, None] + vv[None, :], mask=mask, other=0.0) - lse[:, None])
        p = p - tl.where(vv[None, :] == tgt[:, None], 1.0, 0.0)
        tl.store(row[:, None] + vv[None, :], p * coef[:, None], mask=mask)


def _row_blocks(r: int, v: int) -> tuple[int, int]:
    big = interpreter_active()  # few, big programs there: its cost is per operation, not per element
    block_v = min(triton.next_power_of_2(max(v, 1)), 4096)
    block_r = max(1, min(triton.next_power_of_2(r), 32768 // block_v)) if big else 1
    return block_r, block_v


def chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h: [n, D], weight: [V, D], same float dtype -> logits float32 [n, V].

    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """
    r, d = h.shape
    v = weight.shape[0]
    out = torch.empty((r, v), dtype=torch.float32, device=h.device)
    if r == 0 or v == 0:
        return out
    if interpreter_active():
        bm, bn, bk, extra = 32, 128, 128, {}
    else:
        bm, bn, bk, extra = 128, 128, 64, dict(num_warps=8, num_stages=3)
    grid = (triton.cdiv(r, bm), triton.cdiv(v, bn))
    precision = "ieee" if h.dtype == torch.float32 else "tf32"  # never TF32 for fp32 inputs
    _logits_kernel[grid](
        h,
        weight,
        out,
        r,
        v,
        d,
        h.stride(0),
        h.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        PRECISION=precision,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **extra,
    )
    count_launch("linear_cross_entropy")
    return out


def chunk_lse(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float32 [n, V], targets: int [n] -> (lse float32 [n], nll float32 [n], 0 where ignored).

    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """
    r, v = logits.shape
    lse = torch.empty(r, dtype=torch.float32, device=logits.device)
    nll = torch.empty(r, dtype=torch.float32, device=logits.device)
    if r == 0:
        return lse, nll
    block_r, block_v = _row_blocks(r, v)
    _lse_kernel[(triton.cdiv(r, block_r),)](
        logits, targets, lse, nll, r, v, logits.stride(0), ignore_index, BLOCK_R=block_r, BLOCK_V=block_v
    )
    count_launch("linear_cross_entropy")
    return lse, nll


def chunk_grad_(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """In place: logits float32 [n, V] -> d loss / d logits; scale: float32 [1] (grad_loss / count).

    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """
    r, v = logits.shape
    if r == 0:
        return logits
    block_r, block_v = _row_blocks(r, v)
    _grad_kernel[(triton.cdiv(r, block_r),)](
        logits, targets, lse, scale, r, v, logits.stride(0), ignore_index, BLOCK_R=block_r, BLOCK_V=block_v
    )
    count_launch("linear_cross_entropy")
    return logits
