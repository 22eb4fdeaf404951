"""MoE token dispatch and combine around `grouped_matmul` (SPEC 2.8), shared by every expert module
(float, W8A8, W4A8, FP8): one place that sorts (token, slot) pairs by expert and sums them back.

Both halves have fixed output shapes (no data-dependent sizes, so `torch.compile` and CUDA graphs
capture them) and are deterministic on every device: offsets come from a binary search over the
sorted expert ids, not a histogram, and the combine gathers each token's k results back into slot
order and sums them in that order, where `index_add_` would use atomics on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dispatch:
    """order: int64 [T*k], (token, slot) pairs sorted by expert (stable); token: int64 [T*k] the token of
    each sorted pair; offsets: int64 [E+1] `group_offsets` of the sorted rows; inverse: int64 [T*k] the
    sorted position of pair (t, j) = t*k + j."""

    order: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor
    top_k: int


def dispatch(ids: torch.Tensor, n_experts: int) -> Dispatch:
    """ids: int [T, k] expert of each (token, slot) -> the expert-sorted order and group offsets."""
    t, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, dtype=torch.int64, device=ids.device)
    offsets = torch.searchsorted(flat[order], bounds)  # first sorted row of each expert; [E] = T*k
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=ids.device)
    return Dispatch(order, order // k, offsets, inverse, k)


def zero_padding_rows(out: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """out [M, N] with the rows past group_offsets[-1] set to zero, on the device (no host read): SPEC 2.8's
    padding rows, for a backend whose kernel leaves them unwritten."""
    rows = torch.arange(out.shape[0], device=out.device)[:, None]
    return out.masked_fill_(rows >= group_offsets[-1].to(out.device), 0)


def combine(y: torch.Tensor, weights: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """y: [T*k, D] expert outputs in sorted order, weights: fp32 [T, k] -> fp32 [T, D]
    sum_j weights[t, j] * y[sorted position of (t, j)], summed over j in slot order."""
    t = weights.shape[0]
    per_slot = y.float()[d.inverse].view(t, d.top_k, -1)  # [T, k, D]
    return (per_slot * weights.float()[..., None]).sum(dim=1)
