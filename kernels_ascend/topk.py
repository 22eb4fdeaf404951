"""Deterministic row-wise top-k for Ascend (SPEC 2.3) without tl.sort.

One program per vector core; each loops over rows pid, pid + P, ... . The rule is a total order

    (class asc: number < NaN; value desc; index asc)      non-candidates (col >= length) never chosen

Each candidate gets an int32 key, monotone in (class, value): the fp32 widening's magnitude bits, negated
for negative values (so -0.0 and +0.0 share key 0), and INT32_MIN for NaN (every payload and sign alike;
-inf is -0x7F800000). A row of n candidates, kk = min(k, n), takes four phases:

0. keys: one pass over x writes the row's keys to an [R, C] int32 scratch (1-D tiles of BLOCK_C columns).
   A row that keeps every candidate (kk == n, or n <= SMALL_ROW, where ranking all of them is cheaper
   than the search) writes them to the kept area instead (slot = column) and goes to phase 3.
1. threshold: tau = the kk-th largest key, built bit by bit from the sign down to bit LOW from counts
   #(key >= trial), one 1-D pass over the keys per bit, counted per lane and reduced once per pass.
   fp16 / bf16 widenings have the low 13 / 16 bits of every key zero, so those are skipped (LOW).
2. selection: every key > tau is kept, and the first kk - #(key > tau) ties == tau in column order (one
   cumsum per tile carries both running counts); the kept (key, column) pairs go, in column order, to an
   [R, max(k, min(C, SMALL_ROW))] int32 scratch.
3. order: each kept entry's rank = #(kept entries with a larger key, or an equal key in an earlier slot),
   counted tile against tile (BLOCK_R x BLOCK_R, 16 KB per int32 tile pair, inside the unified buffer);
   entries ranked < kk are scattered to output slot `rank`.

Cost per row: fp32 35, fp16 22, bf16 19 passes over n keys in 1-D tiles (8 KB) plus kk^2 compares
(min(n, SMALL_ROW)^2 for short rows); scratch R * (C + 2 max(k, min(C, SMALL_ROW))) * 4 bytes. Every
step is a count or a cumsum in column order: no sort, no atomics, ties resolve to the lower index exactly
as the reference. Comparisons are of keys of the fp32 widening (exact for fp16/bf16); values are copied
from x as integers of their width, so -0.0 / +0.0 (and NaN payloads) come back as given. Slots past kk
keep the wrapper's -inf / -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

#: columns per 1-D tile of the threshold and selection passes (8 KB of int32 keys)
BLOCK_C = 2048
#: kept entries per side of the phase-3 rank tile
BLOCK_R = 64
#: rows of at most this many candidates skip the threshold search: all are kept and ranked (4 x 4 tiles)
SMALL_ROW = 256
#: the values are copied as integers of the same width, so each comes back bit for bit (NaN payloads too)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: bits of the key that are zero for every value of the dtype (its fp32 widening's unused mantissa)
LOW_BITS = {torch.float32: 0, torch.float16: 13, torch.bfloat16: 16}


@triton.jit
def _topk_kernel(
    x_ptr,
    xbits_ptr,
    len_ptr,
    vbits_ptr,
    idx_ptr,
    key_ptr,
    skey_ptr,
    scol_ptr,
    R,
    C,
    K,
    W,
    stride_x,
    rows_per_prog,
    HAS_LEN: tl.constexpr,
    NPROG: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOW: tl.constexpr,
    SMALL_N: tl.constexpr,
):
    pid = tl.program_id(0)
    for it in range(0, rows_per_prog):
        row = pid + it * NPROG
        if row < R:
            n = C
            if HAS_LEN:
                n = tl.minimum(tl.maximum(tl.load(len_ptr + row).to(tl.int32), 0), C)
            kk = tl.minimum(n, K)
            x_row = x_ptr + row * stride_x
            key_row = key_ptr + row * C
            out = row * W  # the row's kept entries in the scratch
            if kk > 0:
                # a row that keeps every candidate (kk == n, or a short row, ranked whole: cheaper than the
                # search) writes its keys straight to the kept area (slot = column) and skips phases 1-2
                keep_all = (kk == n) | (n <= SMALL_N)
                search = (kk < n) & (n > SMALL_N)  # not keep_all
                # 0. keys
                for c0 in range(0, n, BLOCK):
                    offs = c0 + tl.arange(0, BLOCK)
                    m = offs < n
                    bits = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
                    mag = bits & 0x7FFFFFFF
                    key = tl.where(bits < 0, -mag, mag)
                    key = tl.where(mag > 0x7F800000, tl.full([BLOCK], -2147483648, tl.int32), key)
                    tl.store(key_row + offs, key, mask=m & search)
                    tl.store(skey_ptr + out + offs, key, mask=m & keep_all)
                    tl.store(scol_ptr + out + offs, offs, mask=m & keep_all)
                tl.debug_barrier()  # the keys stored above are read back below
                n_keep = n
                if search:
                    n_keep = kk
                    # 1. tau = max t with #(key >= t) >= kk, bit by bit in the order of u = key + 2^31: tau
                    # starts at INT32_MIN (u = 0, where the count is n >= kk) and toggling bit 31 - s of tau
                    # sets that bit of u (1 << 31 is INT32_MIN). Columns past n load INT32_MIN, below every
                    # trial: never counted. Counts are accumulated per lane and reduced once per pass.
                    tau = tl.full([], -2147483648, tl.int32)
                    for s in range(0, 32 - LOW):
                        trial = tau ^ (1 << (31 - s))
                        acc = tl.zeros([BLOCK], dtype=tl.int32)
                        for c0 in range(0, n, BLOCK):
                            offs = c0 + tl.arange(0, BLOCK)
                            key = tl.load(key_row + offs, mask=offs < n, other=-2147483648)
                            acc += (key >= trial).to(tl.int32)
                        tau = tl.where(tl.sum(acc, axis=0) >= kk, trial, tau)
                    # 2. keep keys > tau and the first `room` ties == tau, compacted in column order. One
                    # cumsum carries both running counts: keys above in the high half, ties in the low.
                    tl.static_assert(BLOCK < 65536)
                    acc = tl.zeros([BLOCK], dtype=tl.int32)
                    for c0 in range(0, n, BLOCK):
                        offs = c0 + tl.arange(0, BLOCK)
                        acc += (tl.load(key_row + offs, mask=offs < n, other=-2147483648) > tau).to(tl.int32)
                    room = kk - tl.sum(acc, axis=0)
                    above = 0  # keys > tau in earlier tiles
                    ties = 0  # keys == tau in earlier tiles
                    for c0 in range(0, n, BLOCK):
                        offs = c0 + tl.arange(0, BLOCK)
                        m = offs < n
                        key = tl.load(key_row + offs, mask=m, other=-2147483648)
                        gt = key > tau
                        eq = m & (key == tau)
                        packed = gt.to(tl.int32) * 65536 + eq.to(tl.int32)
                        both = tl.cumsum(packed, axis=0)
                        tie_rank = ties + (both & 65535)  # 1-based among the row's ties, for an eq lane
                        take = gt | (eq & (tie_rank <= room))
                        slot = out + above + (both >> 16) + tl.minimum(tie_rank, room) - 1
                        tl.store(skey_ptr + slot, key, mask=take)
                        tl.store(scol_ptr + slot, offs, mask=take)
                        total = tl.sum(packed, axis=0)
                        above += total >> 16
                        ties += total & 65535
                    tl.debug_barrier()  # the kept entries stored above are read back below
                # 3. rank of each kept entry among the n_keep (slot order is column order); slots past n_keep
                # load INT32_MIN at a later slot, so they never count as before a kept entry
                for i0 in range(0, n_keep, BLOCK_K):
                    oi = i0 + tl.arange(0, BLOCK_K)
                    mi = oi < n_keep
                    ki = tl.load(skey_ptr + out + oi, mask=mi, other=0)
                    ci = tl.load(scol_ptr + out + oi, mask=mi, other=0)
                    acc2 = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.int32)
                    for j0 in range(0, n_keep, BLOCK_K):
                        oj = j0 + tl.arange(0, BLOCK_K)
                        kj = tl.load(skey_ptr + out + oj, mask=oj < n_keep, other=-2147483648)
                        later = oj[None, :] < oi[:, None]
                        acc2 += ((kj[None, :] > ki[:, None]) | ((kj[None, :] == ki[:, None]) & later)).to(
                            tl.int32
                        )
                    rank = tl.sum(acc2, axis=1)
                    win = mi & (rank < kk)
                    xv = tl.load(xbits_ptr + row * stride_x + ci, mask=win)  # the element's bits, as given
                    tl.store(vbits_ptr + row * K + rank, xv, mask=win)
                    tl.store(idx_ptr + row * K + rank, ci, mask=win)


def topk(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] float; lengths: int [R] or None. Returns (values [R, k] x.dtype, indices int32 [R, k]).
    Semantics: backends/reference/topk.py (SPEC 2.3)"""
    r, c = x.shape
    values = torch.full((r, k), float("-inf"), dtype=x.dtype, device=x.device)
    indices = torch.full((r, k), -1, dtype=torch.int32, device=x.device)
    if r == 0 or c == 0:
        return values, indices
    x = x.contiguous()
    nprog = min(num_cores("vectorcore"), r)
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else indices  # dummy pointer if absent
    keys = torch.empty((r, c), dtype=torch.int32, device=x.device)
    w = max(k, min(c, SMALL_ROW))
    kept = torch.empty((2, r, w), dtype=torch.int32, device=x.device)  # kept keys, kept columns
    _topk_kernel[(nprog,)](
        x,
        x.view(BITS[x.dtype]),
        lens,
        values.view(BITS[x.dtype]),
        indices,
        keys,
        kept[0],
        kept[1],
        r,
        c,
        k,
        w,
        x.stride(0),
        triton.cdiv(r, nprog),
        HAS_LEN=lengths is not None,
        NPROG=nprog,
        BLOCK=BLOCK_C,
        BLOCK_K=BLOCK_R,
        LOW=LOW_BITS[x.dtype],
        SMALL_N=SMALL_ROW,
    )
    count_launch("topk")
    return values, indices
