"""The glm5 custom ops (`torch.ops.glm5.<op>`, backends/contract/library.py) as calls to the `glm5` ONNX
functions (backends/onnxruntime/functions/): the `custom_translation_table` of
`torch.onnx.export(dynamo=True)`.

The model is traced on its own backend: every contract op is already one custom-op node in the exported
program, whose arguments are the op's tensors, the SeqLayout's tensors, `max_seqlen_k` and the backend
key. Each translation picks the function variant from what is static at trace time (ragged or paged by
which layout tensor is None, float or W8A8/W4A8 by dtype, with or without bias / lengths), passes the
static arguments as attributes, and ignores `max_seqlen_k` (the functions compute it in-graph) and the
backend key (the ONNX graph has no backend). The functions' attribute choices are the onnxruntime
backend's (backends/onnxruntime/<op>.py), so the exported graph computes what that backend computes.
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import ir

from backends.onnxruntime.functions import DOMAIN, function_closure
from backends.onnxruntime.functions._opsets import op
from backends.onnxruntime.indexer_topk import KEY_CHUNK
from backends.onnxruntime.linear_cross_entropy import CHUNK_ELEMS
from glm5.onnx_export import calls

#: the glm5 ops the table translates (SPEC 2.1-2.10, the onnxruntime backend's: not FP8)
TRANSLATED = (
    "indexer_logits",
    "indexer_topk",
    "topk",
    "sparse_mla_attention",
    "dynamic_quant_int8",
    "w8a8_matmul",
    "w4a8_matmul",
    "grouped_matmul",
    "linear_cross_entropy",
    "silu_and_mul",
)


def _static_rows(cache: ir.Value, what: str) -> None:
    """The functions gather row 0 for invalid slots, so a cache needs a row (the onnxruntime backend
    substitutes one zero row at run time; a traced graph's shapes are fixed, so refuse it here)."""
    shape = cache.shape
    dims = [] if shape is None else list(shape)[:-1]
    if any(isinstance(d, int) and d == 0 for d in dims):
        raise ValueError(f"{what}: a cache with no rows cannot be exported (the functions gather row 0)")


def _layout_tail(cu_seqlens_k, block_table) -> tuple[str, ir.Value]:
    return ("ragged", cu_seqlens_k) if block_table is None else ("paged", block_table)


def _dtype_of(out_dtype, like: ir.Value) -> int:
    """The TensorProto type for `out_dtype` (the exporter passes a torch dtype as an ir.DataType); None:
    the dtype of `like`."""
    return int(like.dtype if out_dtype is None else out_dtype)


def indexer_logits(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k, backend
):
    _static_rows(k_cache, "indexer_logits")
    kind, tail = _layout_tail(cu_seqlens_k, block_table)
    fn = calls.call_indexer_logits_ragged if kind == "ragged" else calls.call_indexer_logits_paged
    return fn(q, k_cache, weights, cu_seqlens_q, seqlens_k, tail)


def indexer_topk(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k, topk, backend
):
    _static_rows(k_cache, "indexer_topk")
    kind, tail = _layout_tail(cu_seqlens_k, block_table)
    fn = calls.call_indexer_topk_ragged if kind == "ragged" else calls.call_indexer_topk_paged
    return fn(q, k_cache, weights, cu_seqlens_q, seqlens_k, tail, topk=topk, chunk=KEY_CHUNK)


def topk(x, k, lengths, backend):
    if lengths is None:
        return calls.call_topk(x, k=k)
    return calls.call_topk_lengths(x, lengths, k=k)


def sparse_mla_attention(
    q,
    kv_cache,
    indices,
    cu_seqlens_q,
    seqlens_k,
    cu_seqlens_k,
    block_table,
    max_seqlen_k,
    sm_scale,
    d_v,
    return_lse,
    backend,
):
    _static_rows(kv_cache, "sparse_mla_attention")
    kind, tail = _layout_tail(cu_seqlens_k, block_table)
    fn = calls.call_sparse_mla_attention_ragged if kind == "ragged" else calls.call_sparse_mla_attention_paged
    out, lse = fn(q, kv_cache, indices, cu_seqlens_q, seqlens_k, tail, sm_scale=float(sm_scale), d_v=d_v)
    if not return_lse:
        # the custom op returns an empty [0] lse then (a schema has no optional outputs)
        lse = op.Constant(value=ir.tensor([], dtype=ir.DataType.FLOAT))
    return out, lse


def silu_and_mul(x, backend):
    return calls.call_silu_and_mul(x)


def dynamic_quant_int8(x, backend):
    return calls.call_dynamic_quant_int8(x)


def _no_empty_k(x_q: ir.Value, what: str) -> None:
    """K = 0: ORT's MatMulInteger leaves its output uninitialised (the onnxruntime backend answers the
    epilogue of zero in torch instead), so a graph with a static empty K is refused."""
    shape = x_q.shape
    if shape is not None and len(shape) == 2 and isinstance(shape[1], int) and shape[1] == 0:
        raise ValueError(f"{what}: K = 0 cannot be exported (ONNX MatMulInteger leaves it uninitialised)")


def w8a8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype, backend):
    _no_empty_k(x_q, "w8a8_matmul")
    dt = _dtype_of(out_dtype, x_scale)
    if bias is None:
        return calls.call_w8a8_matmul(x_q, x_scale, w_q, w_scale, out_dtype=dt)
    return calls.call_w8a8_matmul_bias(x_q, x_scale, w_q, w_scale, bias, out_dtype=dt)


def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size, bias, out_dtype, backend):
    _no_empty_k(x_q, "w4a8_matmul")
    dt = _dtype_of(out_dtype, x_scale)
    if bias is None:
        return calls.call_w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size=group_size, out_dtype=dt)
    return calls.call_w4a8_matmul_bias(
        x_q, x_scale, w_packed, w_scale, bias, group_size=group_size, out_dtype=dt
    )


def grouped_matmul(x, w, group_offsets, x_scale, w_scale, group_size, out_dtype, backend):
    dt = _dtype_of(out_dtype, x)
    if x.dtype.is_floating_point():
        return calls.call_grouped_matmul(x, w, group_offsets, out_dtype=dt)
    _no_empty_k(x, "grouped_matmul")
    if w.dtype == ir.DataType.INT8:
        return calls.call_grouped_matmul_w8a8(x, x_scale, w, w_scale, group_offsets, out_dtype=dt)
    return calls.call_grouped_matmul_w4a8(
        x, x_scale, w, w_scale, group_offsets, group_size=group_size, out_dtype=dt
    )


def linear_cross_entropy(h, weight, targets, ignore_index, backend):
    return calls.call_linear_cross_entropy(
        h, weight, targets, ignore_index=ignore_index, chunk_elems=CHUNK_ELEMS
    )


def sort_stable(self, stable=None, dim: int = -1, descending: bool = False):
    """aten.sort.stable (the MoE's argsort of expert ids) as ONNX TopK over the whole axis: TopK breaks
    ties by the lower index, which is exactly a stable sort."""
    k = op.Reshape(op.Gather(op.Shape(self), op.Constant(value_int=dim)), op.Constant(value_ints=[1]))
    values, indices = op.TopK(self, k, axis=dim, largest=1 if descending else 0, sorted=1)
    return values, indices


def searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    """aten.searchsorted.Tensor (the MoE dispatch's group offsets, backends/moe/dispatch.py), which torch's
    ONNX table lacks: the insertion point of each value is the number of sorted elements below it (at or
    below it for right=True), counted over a [..., M, N] comparison."""
    if sorter is not None:
        raise ValueError("searchsorted: sorter= is not exported")
    below = op.LessOrEqual if (right or side == "right") else op.Less
    seq = op.Unsqueeze(sorted_sequence, op.Constant(value_ints=[-2]))  # [..., 1, N]
    val = op.Unsqueeze(self, op.Constant(value_ints=[-1]))  # [..., M, 1]
    n = op.ReduceSum(op.Cast(below(seq, val), to=ir.DataType.INT64), op.Constant(value_ints=[-1]), keepdims=0)
    return op.Cast(n, to=ir.DataType.INT32) if out_int32 else n


def translation_table() -> dict:
    """torch op -> ONNX translation, for `torch.onnx.export(custom_translation_table=...)`."""
    ops = torch.ops.glm5
    table = {getattr(ops, name).default: globals()[name] for name in TRANSLATED}
    table[torch.ops.aten.sort.stable] = sort_stable
    table[torch.ops.aten.searchsorted.Tensor] = searchsorted
    return table


def attach_functions(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Give an exported model the definitions of the glm5 functions its graph calls (and everything they
    call, callees first, as the onnxruntime backend builds them) in place of what the exporter left,
    then check it (full check)."""
    _drop_unused_value_info(proto.graph)
    used = {n.op_type for n in proto.graph.node if n.domain == DOMAIN}
    del proto.functions[:]
    proto.functions.extend(function_closure(sorted(used)))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _drop_unused_value_info(graph: onnx.GraphProto) -> None:
    """Value infos of outputs nothing reads: the exporter annotates the lse a `return_lse=False` call
    discards with the custom op's empty placeholder shape, which the function's [T, H] contradicts."""
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [v for v in graph.value_info if v.name in read]
    del graph.value_info[:]
    graph.value_info.extend(keep)
