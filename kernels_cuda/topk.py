"""Deterministic row-wise top-k (SPEC 2.3) as one Triton kernel.

One program owns ROWS rows of x [R, C] (ROWS > 1 for short rows such as MoE routing's, where one row per
program would leave most of a program idle; 1 for long rows). It streams them in tiles of BS columns in
increasing column order,
maps each value to an order-preserving int32 key and keeps a running candidate buffer (CAP = pow2 >= k + BS
slots per row, global scratch) with a threshold filter; when the buffer could overflow it is compacted to the
row's top k by a bitwise threshold search (see kernels_cuda/_select.py). The end emits the kept entries
sorted by (value desc, column asc) and gathers their values from x.

Numerics: exact. Values are compared as keys of their fp32 widening (exact for fp16/bf16); -0.0 == +0.0
and NaN below -inf as the reference; returned values are the original elements of x (a -0.0 stays -0.0).
Work: one read of the row when the threshold filters well (random data); worst case (ascending rows)
one compaction of CAP entries per CAP - k appended columns. Scratch: R * CAP * 8 bytes (R rounded up to ROWS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_cuda._launches import count_launch, interpreter_active
from kernels_cuda._select import NO_THRESHOLD, append, buffer_slots, compact, order_key, sorted_columns

#: largest k served (the sort of k int64 composites happens in one program's registers)
MAX_K = 8192


@triton.jit
def _topk_kernel(
    x_ptr,
    stride_x,
    len_ptr,
    val_ptr,
    idx_ptr,
    skey_ptr,
    scol_ptr,
    R,
    C,
    k,
    HAS_LEN: tl.constexpr,
    BS: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    in_range = rows < R
    rows64 = rows.to(tl.int64)
    if HAS_LEN:
        n = tl.minimum(tl.load(len_ptr + rows, mask=in_range, other=0).to(tl.int32), C)
    else:
        n = tl.zeros([ROWS], tl.int32) + C
    n = tl.where(in_range, n, 0)  # rows past R have no candidates: their buffers stay empty
    n_row = tl.max(n)
    row_off = rows64 * CAP
    count = tl.zeros([ROWS], tl.int32)
    thr = tl.full([ROWS], NO_THRESHOLD, tl.int64)
    for c0 in range(0, n_row, BS):
        cols = c0 + tl.arange(0, BS)
        cand = cols[None, :] < n[:, None]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=cand, other=0.0).to(tl.float32)
        if tl.max(count) > CAP - BS:
            count, thr = compact(skey_ptr, scol_ptr, row_off, count, thr, k, CAP)
        col = cols[None, :] + tl.zeros([ROWS, BS], tl.int32)
        count = append(skey_ptr, scol_ptr, row_off, count, thr, order_key(x), col, cand, CAP)
    if tl.max(count) > k:
        count, thr = compact(skey_ptr, scol_ptr, row_off, count, thr, k, CAP)
    col = sorted_columns(skey_ptr, scol_ptr, row_off, count, BLOCK_K)  # [ROWS, BLOCK_K]
    slot = tl.arange(0, BLOCK_K)[None, :]
    live = col >= 0
    val = tl.load(x_ptr + rows64[:, None] * stride_x + col, mask=live, other=float("-inf"))
    out = rows64[:, None] * k + slot
    emit = in_range[:, None] & (slot < k)
    tl.store(idx_ptr + out, col, mask=emit)
    tl.store(val_ptr + out, val, mask=emit)


def _tile(c: int) -> int:
    big = 256 if interpreter_active() else 1024
    return max(16, min(big, triton.next_power_of_2(max(c, 1))))


def _rows_per_program(r: int, cap: int) -> int:
    """Rows one program takes: enough for a [ROWS, CAP] buffer tile of about 4K slots (16 rows of a
    256-expert router), one for rows whose buffer alone is that large."""
    return max(1, min(triton.next_power_of_2(r), 4096 // cap, 16))


def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] float32/float16/bfloat16; lengths: [R] int32/int64 or None; 1 <= k <= MAX_K.

    Returns (values [R, k] dtype of x, indices [R, k] int32), -inf / -1 past min(k, lengths[r]).
    Semantics: backends/reference/topk.py (SPEC 2.3)
    """
    r, c = x.shape
    values = torch.empty((r, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((r, k), dtype=torch.int32, device=x.device)
    if r == 0:
        return values, indices
    x = x if x.stride(1) == 1 else x.contiguous()
    bs = _tile(c)
    block_k, cap = buffer_slots(k, bs)
    rows = _rows_per_program(r, cap)
    grid = triton.cdiv(r, rows)
    skey = torch.empty((grid * rows, cap), dtype=torch.int32, device=x.device)  # rows past R: masked
    scol = torch.empty((grid * rows, cap), dtype=torch.int32, device=x.device)
    lens = lengths if lengths is not None else indices  # unused pointer when HAS_LEN is false
    count_launch("topk")
    _topk_kernel[(grid,)](
        x,
        x.stride(0),
        lens,
        values,
        indices,
        skey,
        scol,
        r,
        c,
        k,
        HAS_LEN=lengths is not None,
        BS=bs,
        CAP=cap,
        BLOCK_K=block_k,
        ROWS=rows,
        num_warps=8 if block_k >= 2048 else 4,
    )
    return values, indices
