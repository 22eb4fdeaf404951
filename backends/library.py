"""The contract ops as torch custom ops: `torch.ops.glm5.<op>`, registered once, for every backend.

Engines host kernels this way (vLLM and SGLang register theirs with `torch.library`): the op is one
opaque node to `torch.compile`, `torch.export` and CUDA graphs, with a fake implementation that gives
output shapes and dtypes without running anything. Inside, the real implementation dispatches to the
backend instance named by the op's last argument (`Backend.key`), so one registration serves every
backend, built-in or plugin.

A `SeqLayout` crosses the boundary as its tensors plus `max_seqlen_k` (-1: unknown). Differentiable
ops get autograd one way: a `<op>_backward` custom op runs the backend's declared backward
(`OpImpl.backward`) on the saved inputs and the forward's saved outputs (sparse attention's out and lse,
linear cross-entropy's per-row lse; grouped_matmul's float variant, registered in
backends/library_moe.py, saves none), so a training step runs each forward once.

Semantics of every op: backends/reference/<op>.py (docs/spec.md section 2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backends.cache_layout import MLAPools
from backends.custom_op import (
    _layout,
    _lib_op,
    _run,
    attention_fake,
    layout_args,
    run_attention,
    run_backward,
)
from backends.library_moe import grouped_matmul

# -- indexer_logits (SPEC 2.1) ---------------------------------------------------------------------


@_lib_op("indexer_logits")
def indexer_logits(
    q: Tensor,
    k_cache: Tensor,
    weights: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    backend: str,
) -> Tensor:
    layout = _layout(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    return _run(backend, "indexer_logits", dict(q=q, k_cache=k_cache, weights=weights, layout=layout))


@indexer_logits.register_fake
def _(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k, backend):
    s = max_seqlen_k if max_seqlen_k >= 0 else torch.library.get_ctx().new_dynamic_size()
    return q.new_empty((q.shape[0], s), dtype=torch.float32)


@_lib_op("indexer_logits_backward")
def indexer_logits_backward(
    grad: Tensor,
    q: Tensor,
    k_cache: Tensor,
    weights: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    layout = _layout(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    args = dict(q=q, k_cache=k_cache, weights=weights, layout=layout)
    return run_backward(backend, "indexer_logits", args, (None,), (grad,))


@indexer_logits_backward.register_fake
def _(grad, q, k_cache, weights, *rest):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(weights)


def _indexer_logits_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.scalars = inputs[7:]


def _indexer_logits_bwd(ctx, grad):
    dq, dk, dw = indexer_logits_backward(grad, *ctx.saved_tensors, *ctx.scalars)
    return dq, dk, dw, None, None, None, None, None, None


indexer_logits.register_autograd(_indexer_logits_bwd, setup_context=_indexer_logits_setup)

# -- indexer_topk (SPEC 2.2) -----------------------------------------------------------------------


@_lib_op("indexer_topk")
def indexer_topk(
    q: Tensor,
    k_cache: Tensor,
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
    return _run(
        backend, "indexer_topk", dict(q=q, k_cache=k_cache, weights=weights, layout=layout, topk=topk)
    )


@indexer_topk.register_fake
def _(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k, topk, backend):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


# -- topk (SPEC 2.3) -------------------------------------------------------------------------------


@_lib_op("topk")
def topk(x: Tensor, k: int, lengths: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    return _run(backend, "topk", dict(x=x, k=k, lengths=lengths))


@topk.register_fake
def _(x, k, lengths, backend):
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32)


# -- sparse_mla_attention (SPEC 2.4) ---------------------------------------------------------------


@_lib_op("sparse_mla_attention")
def sparse_mla_attention(
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
    """lse is an empty [0] float32 tensor when return_lse is False (a schema has no optional outputs)."""
    lay = (cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    return run_attention(
        "sparse_mla_attention", backend, q, kv_cache, indices, lay, sm_scale, d_v, return_lse
    )


@sparse_mla_attention.register_fake
def _(q, kv_cache, indices, cu_q, sk, cu_k, bt, max_k, sm_scale, d_v, return_lse, backend):
    return attention_fake(q, d_v, return_lse)


@_lib_op("sparse_mla_attention_backward")
def sparse_mla_attention_backward(
    d_out: Tensor,
    d_lse: Tensor | None,
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    out: Tensor,
    lse: Tensor,
    max_seqlen_k: int,
    sm_scale: float,
    d_v: int,
    return_lse: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """From the saved out and lse. The front door makes the forward return lse whenever a gradient will be
    taken (`OpImpl.backward_forces`); only a direct call of the op with return_lse=False gets its lse
    here, from one more forward."""
    layout = _layout(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    args = dict(
        q=q, kv_cache=kv_cache, indices=indices, layout=layout, sm_scale=sm_scale, d_v=d_v, return_lse=True
    )
    if not (return_lse and lse.numel()):
        out, lse = _run(backend, "sparse_mla_attention", args)
    grads = (d_out, d_lse if return_lse else None)
    return run_backward(backend, "sparse_mla_attention", args, (out, lse), grads)


@sparse_mla_attention_backward.register_fake
def _(d_out, d_lse, q, kv_cache, *rest):
    return torch.empty_like(q), torch.empty_like(kv_cache)


def _sparse_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], *output)  # out and lse: what an explicit backward reads
    ctx.scalars = inputs[7:]


def _sparse_bwd(ctx, d_out, d_lse):  # one gradient per input of the op
    dq, dkv = sparse_mla_attention_backward(d_out, d_lse, *ctx.saved_tensors, *ctx.scalars)
    return (dq, dkv) + (None,) * 10


sparse_mla_attention.register_autograd(_sparse_bwd, setup_context=_sparse_setup)


@_lib_op("sparse_mla_attention_pools")
def sparse_mla_attention_pools(
    q: Tensor,
    kv_latent: Tensor,
    kv_rope: Tensor,
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
    """sparse_mla_attention on a split-pool cache (backends/cache_layout.py; inference only: no autograd)."""
    lay = (cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    pools = MLAPools(kv_latent, kv_rope)
    return run_attention("sparse_mla_attention", backend, q, pools, indices, lay, sm_scale, d_v, return_lse)


@sparse_mla_attention_pools.register_fake
def _(q, kv_latent, kv_rope, indices, cu_q, sk, cu_k, bt, max_k, sm_scale, d_v, return_lse, backend):
    return attention_fake(q, d_v, return_lse)


# -- dynamic_quant_int8 (SPEC 2.5) -----------------------------------------------------------------


@_lib_op("dynamic_quant_int8")
def dynamic_quant_int8(x: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _run(backend, "dynamic_quant_int8", dict(x=x))


@dynamic_quant_int8.register_fake
def _(x, backend):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


# -- w8a8_matmul / w4a8_matmul (SPEC 2.6, 2.7) -----------------------------------------------------


@_lib_op("w8a8_matmul")
def w8a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    args = dict(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, bias=bias, out_dtype=out_dtype)
    return _run(backend, "w8a8_matmul", args)


@w8a8_matmul.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype, backend):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


@_lib_op("w4a8_matmul")
def w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    group_size: int,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    args = dict(
        x_q=x_q,
        x_scale=x_scale,
        w_packed=w_packed,
        w_scale=w_scale,
        group_size=group_size,
        bias=bias,
        out_dtype=out_dtype,
    )
    return _run(backend, "w4a8_matmul", args)


@w4a8_matmul.register_fake
def _(x_q, x_scale, w_packed, w_scale, group_size, bias, out_dtype, backend):
    return x_q.new_empty((x_q.shape[0], w_packed.shape[0]), dtype=out_dtype)


# -- linear_cross_entropy (SPEC 2.9) ---------------------------------------------------------------


@_lib_op("linear_cross_entropy")
def linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, backend: str
) -> tuple[Tensor, Tensor]:
    """(loss, lse [N] fp32): lse, what the backward reads, is the op's second output (SPEC 2.9; empty [0]
    from a backend without a backward); `Backend.linear_cross_entropy` returns the loss alone."""
    return _run(
        backend, "linear_cross_entropy", dict(h=h, weight=weight, targets=targets, ignore_index=ignore_index)
    )


@linear_cross_entropy.register_fake
def _(h, weight, targets, ignore_index, backend):
    return h.new_empty((), dtype=torch.float32), h.new_empty((h.shape[0],), dtype=torch.float32)


@_lib_op("linear_cross_entropy_backward")
def linear_cross_entropy_backward(
    grad: Tensor,
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss: Tensor,
    lse: Tensor,
    ignore_index: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    args = dict(h=h, weight=weight, targets=targets, ignore_index=ignore_index)
    return run_backward(backend, "linear_cross_entropy", args, (loss, lse), (grad, None))


@linear_cross_entropy_backward.register_fake
def _(grad, h, weight, targets, loss, lse, ignore_index, backend):
    return torch.empty_like(h), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output):
    h, weight, targets, ignore_index, backend = inputs
    ctx.save_for_backward(h, weight, targets, *output)  # the loss and the per-row lse
    ctx.mark_non_differentiable(output[1])
    ctx.scalars = (ignore_index, backend)


def _lce_bwd(ctx, grad, _grad_lse):
    dh, dw = linear_cross_entropy_backward(grad, *ctx.saved_tensors, *ctx.scalars)
    return dh, dw, None, None, None


linear_cross_entropy.register_autograd(_lce_bwd, setup_context=_lce_setup)

#: op name -> the custom op (torch.ops.glm5.<op>)
CUSTOM_OPS = {
    "indexer_logits": indexer_logits,
    "indexer_topk": indexer_topk,
    "topk": topk,
    "sparse_mla_attention": sparse_mla_attention,
    "dynamic_quant_int8": dynamic_quant_int8,
    "w8a8_matmul": w8a8_matmul,
    "w4a8_matmul": w4a8_matmul,
    "grouped_matmul": grouped_matmul,
    "linear_cross_entropy": linear_cross_entropy,
}


def custom_op_args(op: str, args: dict[str, Any], key: str) -> tuple:
    """The custom op's positional arguments for the interface's named ones (in interface order): the
    layout flattened in place (its four tensors and max_seqlen_k), the backend key last."""
    flat: list[Any] = []
    for name, value in args.items():
        flat.extend(layout_args(value) if name == "layout" else (value,))
    return (*flat, key)


def call(key: str, op: str, args: dict[str, Any]) -> Any:
    """Call op's custom op with the interface's named arguments (a split-pool cache: its own op)."""
    pools = args.get("kv_cache")
    if op == "sparse_mla_attention" and isinstance(pools, MLAPools):
        flat = custom_op_args(op, {**args, "kv_cache": pools.latent}, key)
        return as_asked(op, args, sparse_mla_attention_pools(flat[0], pools.latent, pools.rope, *flat[2:]))
    return as_asked(op, args, CUSTOM_OPS[op](*custom_op_args(op, args, key)))


def as_asked(op: str, args: dict[str, Any], out: Any) -> Any:
    """The custom op's result as the interface returns it for `args`: sparse attention's lse is None
    unless return_lse (a schema has no optional outputs); linear cross-entropy's loss alone (its lse is
    for the backward)."""
    if op == "sparse_mla_attention" and not args.get("return_lse", True):
        return out[0], None
    if op == "linear_cross_entropy":
        return out[0]
    return out
