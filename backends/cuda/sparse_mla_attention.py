"""cuda backend: sparse_mla_attention (SPEC 2.4) -> kernels_cuda.sparse_mla_attention.

Forward and backward (dq, dkv) kernels gather rows by logical position through the layout (ragged or
paged) in the kernel. Through the custom op (training) the backward kernel reads the forward's saved out
and lse (`backward`), so a training step runs the forward kernel once. The forward is bitwise run-to-run
deterministic; the backward sums dkv rows shared by several queries with fp32 atomic adds, so gradients
are not bitwise run-to-run on a GPU (declared in `limits`).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.cuda.fp8_sparse_mla_attention import IMPL as FP8_ATTENTION
from backends.layout import SeqLayout
from kernels_cuda.sparse_mla_attention import sparse_mla_bwd, sparse_mla_fwd

MAX_D_V = 512
MAX_D_REST = 256
LIMITS = (
    Limit("d_v", max=MAX_D_V, reason="the [heads, d_v] fp32 accumulator is one register tile"),
    Limit("d_qk_minus_d_v", max=MAX_D_REST, reason="the non-value part of a row is one register tile"),
)
NOTES = {"backward_run_to_run": "no: dkv is summed with fp32 atomic adds (forward and dq are deterministic)"}


def _layout(layout: SeqLayout) -> dict[str, Any]:
    return dict(
        cu_seqlens_q=layout.cu_seqlens_q,
        seqlens_k=layout.seqlens_k,
        cu_seqlens_k=layout.cu_seqlens_k,
        block_table=layout.block_table,
    )


def _forward(q, kv_cache, indices, layout, sm_scale, d_v):
    return sparse_mla_fwd(q, kv_cache, indices, sm_scale, d_v, **_layout(layout))


def _backward(q, kv_cache, indices, layout, sm_scale, d_v, out, lse, d_out, d_lse):
    return sparse_mla_bwd(
        q, kv_cache, indices, sm_scale, d_v, **_layout(layout), out=out, lse=lse, d_out=d_out, d_lse=d_lse
    )


def backward(args: dict[str, Any], outputs: tuple, grad_outputs: tuple) -> tuple:
    """(dq, dkv) from the forward's own out and lse (`OpImpl.backward`: the backward kernel alone, no
    recomputed forward)."""
    (out, lse), (d_out, d_lse) = outputs, grad_outputs
    if d_out is None:
        d_out = torch.zeros_like(out)
    a = args
    return _backward(
        a["q"], a["kv_cache"], a["indices"], a["layout"], a["sm_scale"], a["d_v"], out, lse, d_out, d_lse
    )


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, H, d_qk]; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk]; indices: int32 [T, topk].
    Returns (out [T, H, d_v] dtype of q, lse [T, H] float32). Differentiable in q and kv_cache.
    Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
    """
    out, lse = _forward(q, kv_cache, indices, layout, sm_scale, d_v)
    return out, (lse if return_lse else None)


IMPL = by_kind(
    OpImpl(
        sparse_mla_attention,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            limits=LIMITS,
            notes=NOTES,
            run_to_run=True,
            batch_invariant=True,
            differentiable=True,
        ),
        backward=backward,
        backward_forces={"return_lse": True},
    ),
    dict.fromkeys(FP8_KINDS, FP8_ATTENTION),  # FlashMLA's 656-byte rows (SPEC 7.8)
)
