"""One-node wrappers around the glm5 ONNX functions, for the export's translations (translation.py).

torch.onnx traces through (inlines) an onnxscript function that a translation calls and keeps the calls
one level down. So each translation calls a wrapper whose body is one call: what remains in the graph is
a call to the op's own glm5 function (`glm5.indexer_topk_ragged`, ...), as a vendor toolchain expects to
see it, and the model carries that function's definition. Return annotations give the exporter the
number and types of the outputs.
"""

from onnxscript import FLOAT, INT8, INT32, script

from backends.onnxruntime.functions._opsets import TFloat, TOut, glm5
from backends.onnxruntime.functions.dynamic_quant_int8 import dynamic_quant_int8
from backends.onnxruntime.functions.grouped_matmul import (
    grouped_matmul,
    grouped_matmul_w4a8,
    grouped_matmul_w8a8,
)
from backends.onnxruntime.functions.indexer_logits import indexer_logits_paged, indexer_logits_ragged
from backends.onnxruntime.functions.indexer_topk import indexer_topk_paged, indexer_topk_ragged
from backends.onnxruntime.functions.linear_cross_entropy import linear_cross_entropy
from backends.onnxruntime.functions.silu_and_mul import silu_and_mul
from backends.onnxruntime.functions.sparse_mla_attention import (
    sparse_mla_attention_paged,
    sparse_mla_attention_ragged,
)
from backends.onnxruntime.functions.topk import topk, topk_lengths
from backends.onnxruntime.functions.w4a8_matmul import w4a8_matmul, w4a8_matmul_bias
from backends.onnxruntime.functions.w8a8_matmul import w8a8_matmul, w8a8_matmul_bias


@script(glm5)
def call_topk(x: TFloat, k: int) -> tuple[TFloat, INT32]:
    values, indices = topk(x, k=k)
    return values, indices


@script(glm5)
def call_topk_lengths(x: TFloat, lengths, k: int) -> tuple[TFloat, INT32]:
    values, indices = topk_lengths(x, lengths, k=k)
    return values, indices


@script(glm5)
def call_indexer_logits_ragged(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k) -> FLOAT:
    return indexer_logits_ragged(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k)


@script(glm5)
def call_indexer_logits_paged(q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table) -> FLOAT:
    return indexer_logits_paged(q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table)


@script(glm5)
def call_indexer_topk_ragged(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, topk: int, chunk: int
) -> INT32:
    return indexer_topk_ragged(
        q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, topk=topk, chunk=chunk
    )


@script(glm5)
def call_indexer_topk_paged(
    q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table, topk: int, chunk: int
) -> INT32:
    return indexer_topk_paged(
        q, k_cache, weights, cu_seqlens_q, seqlens_k, block_table, topk=topk, chunk=chunk
    )


@script(glm5)
def call_sparse_mla_attention_ragged(
    q: TFloat, kv_cache, indices, cu_seqlens_q, seqlens_k, cu_seqlens_k, sm_scale: float, d_v: int
) -> tuple[TFloat, FLOAT]:
    out, lse = sparse_mla_attention_ragged(
        q, kv_cache, indices, cu_seqlens_q, seqlens_k, cu_seqlens_k, sm_scale=sm_scale, d_v=d_v
    )
    return out, lse


@script(glm5)
def call_sparse_mla_attention_paged(
    q: TFloat, kv_cache, indices, cu_seqlens_q, seqlens_k, block_table, sm_scale: float, d_v: int
) -> tuple[TFloat, FLOAT]:
    out, lse = sparse_mla_attention_paged(
        q, kv_cache, indices, cu_seqlens_q, seqlens_k, block_table, sm_scale=sm_scale, d_v=d_v
    )
    return out, lse


@script(glm5)
def call_silu_and_mul(x: TFloat) -> TFloat:
    return silu_and_mul(x)


@script(glm5)
def call_dynamic_quant_int8(x) -> tuple[INT8, FLOAT]:
    x_q, scale = dynamic_quant_int8(x)
    return x_q, scale


@script(glm5)
def call_w8a8_matmul(x_q, x_scale, w_q, w_scale, out_dtype: int) -> TOut:
    return w8a8_matmul(x_q, x_scale, w_q, w_scale, out_dtype=out_dtype)


@script(glm5)
def call_w8a8_matmul_bias(x_q, x_scale, w_q, w_scale, bias, out_dtype: int) -> TOut:
    return w8a8_matmul_bias(x_q, x_scale, w_q, w_scale, bias, out_dtype=out_dtype)


@script(glm5)
def call_w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size: int, out_dtype: int) -> TOut:
    return w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size=group_size, out_dtype=out_dtype)


@script(glm5)
def call_w4a8_matmul_bias(x_q, x_scale, w_packed, w_scale, bias, group_size: int, out_dtype: int) -> TOut:
    return w4a8_matmul_bias(x_q, x_scale, w_packed, w_scale, bias, group_size=group_size, out_dtype=out_dtype)


@script(glm5)
def call_grouped_matmul(x, w, group_offsets, out_dtype: int) -> TOut:
    return grouped_matmul(x, w, group_offsets, out_dtype=out_dtype)


@script(glm5)
def call_grouped_matmul_w8a8(x, x_scale, w, w_scale, group_offsets, out_dtype: int) -> TOut:
    return grouped_matmul_w8a8(x, x_scale, w, w_scale, group_offsets, out_dtype=out_dtype)


@script(glm5)
def call_grouped_matmul_w4a8(x, x_scale, w, w_scale, group_offsets, group_size: int, out_dtype: int) -> TOut:
    return grouped_matmul_w4a8(
        x, x_scale, w, w_scale, group_offsets, group_size=group_size, out_dtype=out_dtype
    )


@script(glm5)
def call_linear_cross_entropy(h, weight, targets, ignore_index: int, chunk_elems: int) -> tuple[FLOAT, FLOAT]:
    loss, lse = linear_cross_entropy(h, weight, targets, ignore_index=ignore_index, chunk_elems=chunk_elems)
    return loss, lse
