"""What the cuda backend's ops share in the layout-invariant mode (SPEC 12): the exact GEMM they name (the
Triton digit kernel, kernels_cuda/invariant_gemm.py, on CPU tensors too under TRITON_INTERPRET=1; the same
integers as every other engine) and each query's cache rows, found from the layout's tensors on the device
(torch ops, no host read), as the kernels find them in the normal mode."""

from __future__ import annotations

import torch

from backends.layout import SeqLayout

ENGINE = "triton"


def requests(layout: SeqLayout, t: int) -> torch.Tensor:
    """The request of each of the T query tokens: int64 [T]."""
    tokens = torch.arange(t, dtype=torch.int32, device=layout.device)
    return torch.searchsorted(layout.cu_seqlens_q[1:], tokens, right=True)


def causal_counts(layout: SeqLayout, req: torch.Tensor) -> torch.Tensor:
    """Keys each query may see (right-down causality, SPEC 1): int64 [T], req from `requests`."""
    cu_q, s = layout.cu_seqlens_q.long(), layout.seqlens_k.long()[req]
    i = torch.arange(req.shape[0], device=req.device) - cu_q[req]  # the token's place in its request
    return (s - (cu_q[req + 1] - cu_q[req]) + i + 1).clamp(min=0).minimum(s)


def gather(
    cache: torch.Tensor, layout: SeqLayout, req: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The rows at logical `positions` [tq, n] (int64) of the requests req [tq], as fp32 [tq, n, D] with
    zeros where not `valid` (such rows are never read as values: they may hold NaN or lie past the
    request, so their positions are clamped into it and the row into the cache before the gather)."""
    flat = cache.reshape(-1, cache.shape[-1])
    if flat.shape[0] == 0 or (layout.kind == "paged" and layout.block_table.shape[1] == 0):
        return flat.new_zeros((*positions.shape, flat.shape[1]), dtype=torch.float32)  # no key anywhere
    last = (layout.seqlens_k.long()[req] - 1).clamp(min=0)[:, None]
    pos = positions.clamp(min=0).minimum(last)
    if layout.kind == "ragged":
        rows = layout.cu_seqlens_k.long()[req][:, None] + pos
    else:
        bs, table = cache.shape[1], layout.block_table.long()
        blocks = (pos // bs).clamp(max=max(table.shape[1] - 1, 0))
        rows = table[req[:, None], blocks] * bs + pos % bs
    rows = rows.clamp(0, max(flat.shape[0] - 1, 0))
    keys = flat.index_select(0, rows.reshape(-1)).view(*rows.shape, -1).float()
    return keys.masked_fill(~valid[..., None], 0)
