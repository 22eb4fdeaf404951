"""What the two indexer ops of the cuda backend share: limits and the layout arguments of their kernels."""

from __future__ import annotations

from typing import Any

import torch

from backends.contract.limits import Limit
from backends.layout import SeqLayout

MAX_HEADS = 128
MAX_HEAD_DIM = 256
LIMITS = (
    Limit("index_heads", max=MAX_HEADS, reason="(query, head) rows of a tile are one register tile"),
    Limit("index_head_dim", max=MAX_HEAD_DIM, reason="a head row is one register tile"),
)


def check(args: dict[str, Any], *, differentiable_output: bool = True) -> list[str]:
    """For an op with a differentiable output (logits): inputs requiring grad (the kernels have no
    backward)."""
    out = []
    grads = [n for n in ("q", "k_cache", "weights") if args[n].requires_grad]
    if differentiable_output and grads and torch.is_grad_enabled():
        out.append(f"{', '.join(grads)} require grad: the cuda indexer kernels have no backward")
    return out


def layout_args(layout: SeqLayout) -> dict[str, Any]:
    return dict(
        cu_seqlens_q=layout.cu_seqlens_q,
        seqlens_k=layout.seqlens_k,
        cu_seqlens_k=layout.cu_seqlens_k,
        block_table=layout.block_table,
    )
