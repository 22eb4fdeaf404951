"""A backend whose ops read nothing back to the host: right shapes and dtypes, constant values.

It isolates what the front door and the model do around the ops (host reads, graph breaks) from what a
real backend's implementation does inside them."""

from __future__ import annotations

import torch

from backends import Backend
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS


def indexer_logits(q, k_cache, weights, layout):
    return q.new_zeros((q.shape[0], layout.seqlen_k_max()), dtype=torch.float32)


def indexer_topk(q, k_cache, weights, layout, topk):
    return torch.zeros(q.shape[0], topk, dtype=torch.int32, device=q.device)


def topk(x, k, lengths=None):
    return x[:, :1].expand(-1, k).clone(), torch.arange(k, dtype=torch.int32, device=x.device).expand(
        x.shape[0], k
    ).clone()


def sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
    out = q[..., :d_v] * 0.5
    return out, (q.new_zeros(q.shape[:2], dtype=torch.float32) if return_lse else None)


def dynamic_quant_int8(x):
    return torch.zeros_like(x, dtype=torch.int8), torch.ones(x.shape[0], device=x.device)


def w8a8_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    return torch.zeros(x_q.shape[0], w_q.shape[0], dtype=out_dtype, device=x_q.device)


def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size, bias=None, out_dtype=torch.bfloat16):
    return torch.zeros(x_q.shape[0], w_packed.shape[0], dtype=out_dtype, device=x_q.device)


def grouped_matmul(x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None):
    return torch.zeros(x.shape[0], w.shape[1], dtype=out_dtype or x.dtype, device=x.device)


def linear_cross_entropy(h, weight, targets, ignore_index=-100):
    return (h.float().sum() * 0).reshape(())


def silu_and_mul(x):
    return x[..., : x.shape[-1] // 2] * 0


_LAYOUTS = ("ragged", "paged")


class NoReadBackend(Backend):
    name = "noread"
    ops = {
        "indexer_logits": OpImpl(indexer_logits, OpCaps(FLOATS, _LAYOUTS)),
        "indexer_topk": OpImpl(indexer_topk, OpCaps(FLOATS, _LAYOUTS)),
        "topk": OpImpl(topk, OpCaps(FLOATS)),
        "sparse_mla_attention": OpImpl(sparse_mla_attention, OpCaps(FLOATS, _LAYOUTS)),
        "dynamic_quant_int8": OpImpl(dynamic_quant_int8, OpCaps(FLOATS)),
        "w8a8_matmul": OpImpl(w8a8_matmul, OpCaps(FLOATS)),
        "w4a8_matmul": OpImpl(w4a8_matmul, OpCaps(FLOATS)),
        "grouped_matmul": OpImpl(grouped_matmul, OpCaps(FLOATS + ("w8a8", "w4a8"))),
        "linear_cross_entropy": OpImpl(linear_cross_entropy, OpCaps(FLOATS)),
        "silu_and_mul": OpImpl(silu_and_mul, OpCaps(FLOATS)),
    }
