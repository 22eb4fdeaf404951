"""The backend ops a GLM-5 prefill graph calls, as torch custom ops that the ONNX exporter maps to
the `glm5` ONNX functions (backends/onnxruntime/functions/).

`ExportBackend` is the backend the model is traced with: each op becomes one `glm5_onnx::<fn>` call
whose tensor arguments are the op's tensors plus the SeqLayout's own tensors, so the exported graph
consumes the layout as the ONNX functions do. Run eagerly (outside export), the custom ops call the
`onnxruntime` backend, which runs the very same functions; under export only their fake (shape)
implementations run. Ops the prefill graph does not use raise NotSupported.
"""

from __future__ import annotations

import torch

import backends
from backends import Backend, NotSupported, SeqLayout


def _ort() -> Backend:
    return backends.get("onnxruntime")


@torch.library.custom_op("glm5_onnx::topk", mutates_args=())
def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = _ort().topk(x, k)
    return values.clone(), indices.clone()


@topk.register_fake
def _(x, k):
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("glm5_onnx::indexer_topk_ragged", mutates_args=())
def indexer_topk_ragged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    layout = SeqLayout(cu_seqlens_q, seqlens_k, cu_seqlens_k=cu_seqlens_k)
    return _ort().indexer_topk(q, k_cache, weights, layout, topk).clone()


@indexer_topk_ragged.register_fake
def _(q, k_cache, weights, cu_seqlens_q, seqlens_k, cu_seqlens_k, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("glm5_onnx::sparse_mla_attention_ragged", mutates_args=())
def sparse_mla_attention_ragged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    sm_scale: float,
    d_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = SeqLayout(cu_seqlens_q, seqlens_k, cu_seqlens_k=cu_seqlens_k)
    out, lse = _ort().sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v)
    return out.clone(), lse.clone()


@sparse_mla_attention_ragged.register_fake
def _(q, kv_cache, indices, cu_seqlens_q, seqlens_k, cu_seqlens_k, sm_scale, d_v):
    return q.new_empty((q.shape[0], q.shape[1], d_v)), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("glm5_onnx::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    return _ort().grouped_matmul(x, w, group_offsets).clone()


@grouped_matmul.register_fake
def _(x, w, group_offsets):
    return x.new_empty((x.shape[0], w.shape[1]))


class ExportBackend(Backend):
    """Traces the model's backend calls into `glm5_onnx::*` custom ops. Inputs are not validated here
    (validation reads values on the host, which tracing cannot); run the model on a real backend first."""

    name = "onnx-export"
    device = "cpu"

    def _unsupported(self, op: str, why: str) -> NotSupported:
        return NotSupported([why], backend=self.name, op=op)

    def topk(self, x, k, lengths=None):
        if lengths is not None:
            raise self._unsupported("topk", "lengths: the prefill graph's routing top-k has none; not wired")
        return torch.ops.glm5_onnx.topk(x, k)

    def indexer_topk(self, q, k_cache, weights, layout, topk):
        if layout.kind != "ragged":
            raise self._unsupported("indexer_topk", "paged caches: the exported prefill graph has no cache")
        return torch.ops.glm5_onnx.indexer_topk_ragged(
            q, k_cache, weights, layout.cu_seqlens_q, layout.seqlens_k, layout.cu_seqlens_k, topk
        )

    def sparse_mla_attention(self, q, kv_cache, indices, layout, sm_scale, d_v):
        if layout.kind != "ragged":
            raise self._unsupported(
                "sparse_mla_attention", "paged caches: the exported prefill graph has no cache"
            )
        return torch.ops.glm5_onnx.sparse_mla_attention_ragged(
            q,
            kv_cache,
            indices,
            layout.cu_seqlens_q,
            layout.seqlens_k,
            layout.cu_seqlens_k,
            float(sm_scale),
            d_v,
        )

    def grouped_matmul(
        self, x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None
    ):
        if not x.dtype.is_floating_point or (out_dtype is not None and out_dtype != x.dtype):
            raise self._unsupported(
                "grouped_matmul", "quantized experts / out_dtype: not wired into export yet"
            )
        return torch.ops.glm5_onnx.grouped_matmul(x, w, group_offsets)

    def _not_in_prefill(self, op: str):
        raise self._unsupported(op, "not used by the exported prefill graph; not wired into export")

    def indexer_logits(self, q, k_cache, weights, layout):
        self._not_in_prefill("indexer_logits")

    def dynamic_quant_int8(self, x):
        self._not_in_prefill("dynamic_quant_int8")

    def w8a8_matmul(self, x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
        self._not_in_prefill("w8a8_matmul")

    def w4a8_matmul(self, x_q, x_scale, w_packed, w_scale, group_size, bias=None, out_dtype=torch.bfloat16):
        self._not_in_prefill("w4a8_matmul")

    def linear_cross_entropy(self, h, weight, targets, ignore_index=-100):
        self._not_in_prefill("linear_cross_entropy")
