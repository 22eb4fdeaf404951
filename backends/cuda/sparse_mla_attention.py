"""cuda backend: sparse_mla_attention (SPEC 2.4) -> kernels_cuda.sparse_mla_attention.

Forward and backward (dq, dkv) kernels gather rows by logical position through the layout (ragged or
paged) in the kernel. Through the custom op (training) the backward kernel reads the forward's saved out
and lse (`backward`), so a training step runs the forward kernel once. The forward is bitwise run-to-run
deterministic; the backward sums dkv rows shared by several queries with fp32 atomic adds, so gradients
are not bitwise run-to-run on a GPU (declared in `limits`).

In the layout-invariant mode (SPEC 12) the forward is `exact_attention` (backends/invariant/attention.py)
on blocks of queries: the named rows gathered on the device (`_invariant.gather`: invalid indices masked,
never read as values), the two products on the Triton exact engine, the log-sum-exp and exp by the
mode's fixed tree and formula: the reference's bits in the mode.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.cuda import _invariant
from backends.cuda.fp8_sparse_mla_attention import IMPL as FP8_ATTENTION
from backends.invariant import engine as invariant
from backends.invariant.attention import exact_attention
from backends.layout import SeqLayout
from kernels_cuda.sparse_mla_attention import sparse_mla_bwd, sparse_mla_fwd

MAX_D_V = 512
MAX_D_REST = 256
LIMITS = (
    Limit("d_v", max=MAX_D_V, reason="the [heads, d_v] fp32 accumulator is one register tile"),
    Limit("d_qk_minus_d_v", max=MAX_D_REST, reason="the non-value part of a row is one register tile"),
)
#: the mode's gathered [tq, topk, d_qk] fp32 keys per query block (elements): 64 MiB
GATHER_ELEMS = 1 << 24
NOTES = {"backward_run_to_run": "no: dkv is summed with fp32 atomic adds (forward and dq are deterministic)"}


def _layout(layout: SeqLayout) -> dict[str, Any]:
    return dict(
        cu_seqlens_q=layout.cu_seqlens_q,
        seqlens_k=layout.seqlens_k,
        cu_seqlens_k=layout.cu_seqlens_k,
        block_table=layout.block_table,
    )


def _exact_forward(q, kv_cache, indices, layout, sm_scale, d_v):
    """SPEC 12: (out [T, H, d_v] dtype of q, lse fp32 [T, H]) by `exact_attention` per block of queries."""
    t, h, d_qk = q.shape
    n = indices.shape[1]
    out = torch.zeros((t, h, d_v), device=q.device)
    lse = torch.full((t, h), float("-inf"), device=q.device)
    req = _invariant.requests(layout, t)
    s = layout.seqlens_k.long()[req]
    step = max(1, GATHER_ELEMS // max(1, n * d_qk))
    for a in range(0, t if n else 0, step):
        z = min(a + step, t)
        idx = indices[a:z].long()
        valid = (idx >= 0) & (idx < s[a:z, None])
        keys = _invariant.gather(kv_cache, layout, req[a:z], idx, valid)
        out[a:z], lse[a:z] = exact_attention(q[a:z].float(), keys, valid, d_v, sm_scale, _invariant.ENGINE)
    return out.to(q.dtype), lse


def _forward(q, kv_cache, indices, layout, sm_scale, d_v):
    if invariant.active():
        return _exact_forward(q, kv_cache, indices, layout, sm_scale, d_v)
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
            layout_invariant=True,
        ),
        backward=backward,
        backward_forces={"return_lse": True},
    ),
    dict.fromkeys(FP8_KINDS, FP8_ATTENTION),  # FlashMLA's 656-byte rows (SPEC 7.8)
)
