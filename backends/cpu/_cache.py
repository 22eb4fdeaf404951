"""Physical cache rows of logical key positions (SPEC 1), vectorised over a request's queries."""

from __future__ import annotations

import torch

from backends.layout import SeqLayout


def flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.reshape(-1, cache.shape[-1])


def rows_of(layout: SeqLayout, b: int, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows of `flat(cache)` holding request b's keys at `positions` (int64, any shape, all in range)."""
    if layout.kind == "ragged":
        return positions + layout.host()["cu_k"][b]
    bs = cache.shape[1]
    blocks = layout.host()["block_table"][b].to(torch.int64)
    return blocks[torch.div(positions, bs, rounding_mode="floor")] * bs + positions % bs


def keys_of_request(cache: torch.Tensor, layout: SeqLayout, b: int, n: int) -> torch.Tensor:
    """Logical keys 0..n-1 of request b as [n, D]: a view for a ragged cache, a gather for a paged one."""
    if layout.kind == "ragged":
        start = layout.host()["cu_k"][b]
        return cache[start : start + n]
    return flat(cache).index_select(0, rows_of(layout, b, torch.arange(n), cache))


def causal_counts(t_b: int, s_b: int) -> torch.Tensor:
    """Keys each of a request's t_b queries may see (right-down causality): [t_b] int64."""
    return (torch.arange(t_b) + (s_b - t_b + 1)).clamp(0, s_b)
