"""Deterministic running top-k shared by `topk` and `indexer_topk` (SPEC 2.3 rule), as @triton.jit helpers.

A program owns ROWS rows and streams their candidates (value, column) in increasing column order. Each row
keeps a candidate buffer of CAP slots in a global scratch area ([rows, CAP] int32 keys and int32 columns),
always in increasing column order:
- append: a tile's candidates whose key beats the row's threshold are appended at `count + cumsum(mask)`;
- compact (when a row could overflow, and once at the end): find the kk-th largest key `tau` of the buffer
  (kk = min(k, count)) by a bitwise binary search over counts `#(key >= v)`, keep every key > tau plus the
  first (lowest-column) ties == tau, in place and in order. Afterwards a row holding k entries uses `tau` as
  its threshold: a later key == tau has a higher column than every kept tie, so only keys > tau can enter.
- emit: sort the kept entries by one int64 composite `key * 2^32 + (2^32 - 1 - column)` descending, which is
  value descending with the lower column first.

Every quantity is a count, a cumulative sum in column order or a sort of unique composites: the selected
set and its order are a function of the values alone (no atomics, nothing scheduling-dependent).
Keys: fp32 -> int32 order-preserving map; -0.0 is first folded into +0.0; NaN maps to INT32_MIN, below
-inf (which maps to -2139095041). Global scratch is written and read back by other threads of the same
program, so phases are separated by `tl.debug_barrier()` (bar.sync orders global accesses within a CTA).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: threshold of a row whose buffer is not full yet: below every int32 key
NO_THRESHOLD = tl.constexpr(-(2**32))


@triton.jit
def order_key(x):
    """fp32 [..] -> int32 [..], monotone in the SPEC 2.3 order (NaN lowest, -0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, tl.full(key.shape, -2147483648, tl.int32), key)


@triton.jit
def append(skey_ptr, scol_ptr, row_off, count, thr, key, col, cand, CAP: tl.constexpr):
    """Append the candidates of one tile ([ROWS, BS] key, col, cand) that beat `thr` ([ROWS] int64).
    row_off: [ROWS] int64 offset of each row's buffer. Returns the new counts."""
    take = cand & (key.to(tl.int64) > thr[:, None])
    pos = count[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
    off = row_off[:, None] + pos
    tl.store(skey_ptr + off, key, mask=take)
    tl.store(scol_ptr + off, col, mask=take)
    return count + tl.sum(take.to(tl.int32), axis=1)


@triton.jit
def compact(skey_ptr, scol_ptr, row_off, count, thr, k, CAP: tl.constexpr):
    """Shrink each row's buffer to its top min(k, count) entries (rule order, column order kept).
    Returns (count, thr) with thr = tau for rows that hold k entries."""
    tl.debug_barrier()  # appended entries were stored by other threads
    slot = tl.arange(0, CAP)
    live = slot[None, :] < count[:, None]
    off = row_off[:, None] + slot[None, :]
    key = tl.load(skey_ptr + off, mask=live, other=-2147483648)
    col = tl.load(scol_ptr + off, mask=live, other=0)
    kk = tl.minimum(count, k)
    # tau = max v with #(key >= v) >= kk, built bit by bit from INT32_MIN (where the count is `count`), in
    # int32: with u = v + 2^31 (unsigned order), setting bit 31 of u flips the sign bit of v and setting a
    # lower bit of u sets the same bit of v
    tau = tl.full(count.shape, -2147483648, tl.int32)
    for bit in tl.static_range(31, -1, -1):
        if bit == 31:
            trial = tau ^ tl.full(count.shape, -2147483648, tl.int32)
        else:
            trial = tau | (1 << bit)
        n = tl.sum((live & (key >= trial[:, None])).to(tl.int32), axis=1)
        tau = tl.where(n >= kk, trial, tau)
    above = live & (key > tau[:, None])
    tie = live & (key == tau[:, None])
    room = kk - tl.sum(above.to(tl.int32), axis=1)
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=1) <= room[:, None]))
    pos = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    tl.debug_barrier()  # every thread has read the buffer before it is rewritten in place
    dst = row_off[:, None] + pos
    tl.store(skey_ptr + dst, key, mask=keep)
    tl.store(scol_ptr + dst, col, mask=keep)
    tl.debug_barrier()
    thr = tl.where(count >= k, tau.to(tl.int64), thr)
    return kk, thr


@triton.jit
def sorted_columns(skey_ptr, scol_ptr, row_off, count, BLOCK_K: tl.constexpr):
    """The first `count` (<= BLOCK_K) buffer entries of each row sorted by the rule: [ROWS, BLOCK_K] int32
    columns, -1 past `count`."""
    tl.debug_barrier()
    slot = tl.arange(0, BLOCK_K)
    live = slot[None, :] < count[:, None]
    off = row_off[:, None] + slot[None, :]
    key = tl.load(skey_ptr + off, mask=live, other=0).to(tl.int64)
    col = tl.load(scol_ptr + off, mask=live, other=0).to(tl.int64)
    comp = key * 4294967296 + (4294967295 - col)
    comp = tl.where(live, comp, -9223372036854775807 - 1)
    comp = tl.sort(comp, dim=1, descending=True)
    out = (4294967295 - (comp & 4294967295)).to(tl.int32)
    return tl.where(live, out, -1)


def buffer_slots(k: int, tile: int) -> tuple[int, int]:
    """(BLOCK_K, CAP): the sort width for k and a buffer that holds k entries plus one more tile."""
    block_k = max(16, triton.next_power_of_2(k))  # tl.sort needs a dimension of at least 2
    return block_k, triton.next_power_of_2(block_k + tile)
