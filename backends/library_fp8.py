"""The FP8 ops (SPEC 7) as torch custom ops `torch.ops.glm5.fp8_*`, registered as backends/library.py
registers the others: the real implementation dispatches to the backend instance named by the last
argument, the fake one gives shapes and dtypes. All forward-only (no autograd). Imported by
backends/interface_fp8.py, so they exist whenever `Backend` does.

Semantics of every op: backends/reference/<op>.py (docs/spec.md section 7).
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends import library
from backends.custom_op import _layout, _lib_op, _run, attention_fake, run_attention

E4M3 = torch.float8_e4m3fn


@_lib_op("fp8_quant_group")
def fp8_quant_group(
    x: Tensor, group_size: int, eps: float, ue8m0: bool, backend: str
) -> tuple[Tensor, Tensor]:
    return _run(backend, "fp8_quant_group", dict(x=x, group_size=group_size, eps=eps, ue8m0=ue8m0))


@fp8_quant_group.register_fake
def _(x, group_size, eps, ue8m0, backend):
    g = -(-x.shape[1] // group_size)
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], g), dtype=torch.float32)


@_lib_op("fp8_block_matmul")
def fp8_block_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale_inv: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    args = dict(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale_inv=w_scale_inv, bias=bias, out_dtype=out_dtype)
    return _run(backend, "fp8_block_matmul", args)


@fp8_block_matmul.register_fake
def _(x_q, x_scale, w_q, w_scale_inv, bias, out_dtype, backend):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


@_lib_op("fp8_grouped_matmul")
def fp8_grouped_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale_inv: Tensor,
    group_offsets: Tensor,
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    args = dict(
        x_q=x_q,
        x_scale=x_scale,
        w_q=w_q,
        w_scale_inv=w_scale_inv,
        group_offsets=group_offsets,
        out_dtype=out_dtype,
    )
    return _run(backend, "fp8_grouped_matmul", args)


@fp8_grouped_matmul.register_fake
def _(x_q, x_scale, w_q, w_scale_inv, group_offsets, out_dtype, backend):
    return x_q.new_empty((x_q.shape[0], w_q.shape[1]), dtype=out_dtype)


@_lib_op("fp8_indexer_logits")
def fp8_indexer_logits(
    q: Tensor,
    k_cache: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    backend: str,
) -> Tensor:
    layout = _layout(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    args = dict(q=q, k_cache=k_cache, k_scale=k_scale, weights=weights, layout=layout)
    return _run(backend, "fp8_indexer_logits", args)


@fp8_indexer_logits.register_fake
def _(q, k_cache, k_scale, weights, cu_q, sk, cu_k, bt, max_seqlen_k, backend):
    s = max_seqlen_k if max_seqlen_k >= 0 else torch.library.get_ctx().new_dynamic_size()
    return q.new_empty((q.shape[0], s), dtype=torch.float32)


@_lib_op("fp8_indexer_topk")
def fp8_indexer_topk(
    q: Tensor,
    k_cache: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    topk: int,
    backend: str,
) -> Tensor:
    layout = _layout(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    args = dict(q=q, k_cache=k_cache, k_scale=k_scale, weights=weights, layout=layout, topk=topk)
    return _run(backend, "fp8_indexer_topk", args)


@fp8_indexer_topk.register_fake
def _(q, k_cache, k_scale, weights, cu_q, sk, cu_k, bt, max_seqlen_k, topk, backend):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@_lib_op("fp8_mla_cache_quant")
def fp8_mla_cache_quant(kv: Tensor, backend: str) -> Tensor:
    return _run(backend, "fp8_mla_cache_quant", dict(kv=kv))


@fp8_mla_cache_quant.register_fake
def _(kv, backend):
    return kv.new_empty((kv.shape[0], 656), dtype=torch.uint8)


@_lib_op("fp8_sparse_mla_attention")
def fp8_sparse_mla_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    sm_scale: float,
    d_v: int,
    return_lse: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """lse is an empty [0] float32 tensor when return_lse is False (as sparse_mla_attention)."""
    lay = (cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    return run_attention(
        "fp8_sparse_mla_attention", backend, q, kv_cache, indices, lay, sm_scale, d_v, return_lse
    )


@fp8_sparse_mla_attention.register_fake
def _(q, kv_cache, indices, cu_q, sk, cu_k, bt, max_k, sm_scale, d_v, return_lse, backend):
    return attention_fake(q, d_v, return_lse)


CUSTOM_OPS = {
    "fp8_quant_group": fp8_quant_group,
    "fp8_block_matmul": fp8_block_matmul,
    "fp8_grouped_matmul": fp8_grouped_matmul,
    "fp8_indexer_logits": fp8_indexer_logits,
    "fp8_indexer_topk": fp8_indexer_topk,
    "fp8_mla_cache_quant": fp8_mla_cache_quant,
    "fp8_sparse_mla_attention": fp8_sparse_mla_attention,
}
library.CUSTOM_OPS.update(CUSTOM_OPS)  # Backend._call reaches every op through library.call
