"""Test-side builders for batches of requests (SPEC 1), written independently of the reference.

A case is a list of requests, each with its queries and its logical keys `[S_b, D]`; `pack` lays the
keys out in a ragged cache (with NaN gaps between requests) or a paged cache (odd block size,
shuffled block table, spare NaN blocks), so a reader that ignores the layout reads NaN.
"""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st

from backends import SeqLayout

NAN = float("nan")


def visible_counts(q_lens: list[int], k_lens: list[int]) -> list[int]:
    """Right-down causality, spelled out per query: query i of request b sees keys 0 .. S_b - T_b + i."""
    out = []
    for t_b, s_b in zip(q_lens, k_lens, strict=True):
        for i in range(t_b):
            out.append(min(max(s_b - t_b + i + 1, 0), s_b))
    return out


def request_of_token(q_lens: list[int]) -> list[int]:
    return [b for b, t_b in enumerate(q_lens) for _ in range(t_b)]


def pack(
    keys: list[torch.Tensor],
    q_lens: list[int],
    *,
    block_size: int | None = None,
    gap: int = 2,
    spare_blocks: int = 2,
    seed: int = 0,
    fill: float = NAN,
    d: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, SeqLayout]:
    """Lay out per-request logical keys [S_b, D] as a ragged (`block_size=None`) or paged cache.

    Ragged: request b starts after `gap` filler rows. Paged: blocks in a shuffled order among
    `spare_blocks` extra filler blocks; the last block of each request is partly filler.
    """
    rng = random.Random(seed)
    d = d or (keys[0].shape[1] if keys else 1)
    dtype = dtype or (keys[0].dtype if keys else torch.float32)
    k_lens = [k.shape[0] for k in keys]
    cu_q = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    sk = torch.tensor(k_lens, dtype=torch.int32)
    if block_size is None:
        starts, row = [], 0
        for s in k_lens:
            row += gap
            starts.append(row)
            row += s
        cache = torch.full((row + gap, d), fill, dtype=dtype)
        for st_, k in zip(starts, keys, strict=True):
            cache[st_ : st_ + k.shape[0]] = k
        cu_k = torch.tensor(starts + [row], dtype=torch.int32)
        return cache, SeqLayout(cu_q, sk, cu_seqlens_k=cu_k)
    need = [-(-s // block_size) for s in k_lens]
    total = sum(need) + spare_blocks
    ids = list(range(total))
    rng.shuffle(ids)
    cache = torch.full((total, block_size, d), fill, dtype=dtype)
    table = torch.full((len(keys), max(need + [1]) + 1), -1, dtype=torch.int32)  # one unused column
    i = 0
    for b, (n, k) in enumerate(zip(need, keys, strict=True)):
        for j in range(n):
            blk = ids[i]
            i += 1
            table[b, j] = blk
            rows = k[j * block_size : (j + 1) * block_size]
            cache[blk, : rows.shape[0]] = rows
    return cache, SeqLayout(cu_q, sk, block_table=table)


def int_valued(
    shape: tuple[int, ...],
    gen: torch.Generator,
    lo: int = -3,
    hi: int = 4,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Small integers as floats: every dot product is exact, so ties are real ties on any backend."""
    return torch.randint(lo, hi, shape, generator=gen).to(dtype)


@st.composite
def batches(draw, max_requests: int = 3, max_q: int = 6, max_k: int = 40) -> dict:
    """Request counts (incl. zero), zero-length requests, T_b > S_b, layouts with odd block sizes."""
    b = draw(st.integers(0, max_requests))
    q_lens = [draw(st.integers(0, max_q)) for _ in range(b)]
    k_lens = [draw(st.integers(0, max_k)) for _ in range(b)]
    block_size = draw(st.sampled_from([None, None, 1, 3, 7, 16]))
    return dict(q_lens=q_lens, k_lens=k_lens, block_size=block_size, seed=draw(st.integers(0, 2**16)))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of `dtype` at the magnitude of x (fp64 in, fp64 out)."""
    fi = torch.finfo(dtype)
    mag = x.abs().double().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps
