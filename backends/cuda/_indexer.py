"""What the two indexer ops of the cuda backend share: limits and the layout arguments of their kernels."""

from __future__ import annotations

from typing import Any

import torch

from backends.layout import SeqLayout

MAX_HEADS = 128
MAX_HEAD_DIM = 256
LIMITS = {"index_heads (H_I)": f"<= {MAX_HEADS}", "index_head_dim (D_I)": f"<= {MAX_HEAD_DIM}"}


def check(args: dict[str, Any], *, differentiable_output: bool = True) -> list[str]:
    """Reasons from the limits; for an op with a differentiable output (logits) also inputs requiring grad."""
    out = []
    _, h_i, d_i = args["q"].shape
    if h_i > MAX_HEADS:
        out.append(f"H_I={h_i} > {MAX_HEADS}: (query, head) rows of a tile are one register tile")
    if d_i > MAX_HEAD_DIM:
        out.append(f"D_I={d_i} > {MAX_HEAD_DIM}: a head row is one register tile")
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
        cu_q_host=layout.host()["cu_q"],
    )
