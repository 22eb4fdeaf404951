"""Reading keys out of a ragged or paged cache by logical position (SPEC 1)."""

from __future__ import annotations

import torch

from backends.cache_layout import MLAPools
from backends.layout import SeqLayout


def keys_of_request(cache: torch.Tensor, layout: SeqLayout, b: int, n: int) -> torch.Tensor:
    """Logical keys 0..n-1 of request b as [n, D] (rows past them are never read)."""
    if layout.kind == "ragged":
        start = layout.host()["cu_k"][b]
        return cache[start : start + n]
    return gather_rows(cache, layout, b, torch.arange(n))


def gather_rows(
    cache: torch.Tensor | MLAPools, layout: SeqLayout, b: int, positions: torch.Tensor
) -> torch.Tensor:
    """Rows of request b at valid logical `positions` (any shape, int64) -> [*positions.shape, D]; a
    split-pool cache gives `cat(latent, rope)` of each row."""
    if isinstance(cache, MLAPools):
        rows = layout.physical_rows(b, positions.reshape(-1).to(torch.int64), cache)
        return cache.rows(rows.to(cache.device)).reshape(*positions.shape, cache.shape[-1])
    flat = cache.reshape(-1, cache.shape[-1])
    rows = layout.physical_rows(b, positions.reshape(-1).to(torch.int64), cache)
    return flat.index_select(0, rows.to(flat.device)).reshape(*positions.shape, cache.shape[-1])


def keys_at(
    cache: torch.Tensor, layout: SeqLayout, b: int, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of `cache.flatten(0, -2)` at the valid positions [n valid], the keys [*positions.shape, D]
    fp32 with zeros where not valid): what a backward reads and where it adds its row gradients."""
    flat = cache.reshape(-1, cache.shape[-1])
    rows = layout.physical_rows(b, positions[valid], cache).to(flat.device)
    keys = flat.new_zeros((*positions.shape, flat.shape[-1]), dtype=torch.float32)
    return rows, keys.index_put((valid,), flat.index_select(0, rows).float())


def causal_counts(t_b: int, s_b: int) -> torch.Tensor:
    """Number of keys each of a request's t_b queries may see (right-down causality): [t_b] int64."""
    i = torch.arange(t_b)
    return (s_b - t_b + i + 1).clamp(0, s_b)
