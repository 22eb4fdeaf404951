"""Tiny valid inputs of the FP8 ops (SPEC 7) for the registry and custom-op checks that walk every op."""

from __future__ import annotations

import torch

from backends.layout import SeqLayout
from backends.reference.fp8_format import quantize_weight_blocks
from backends.reference.fp8_indexer_logits import quantize_indexer_inputs
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant
from backends.reference.fp8_quant_group import fp8_quant_group

_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: dtype of each FP8 op's first output, from its dtype-axis value
FP8_OUT_DTYPE = {
    "fp8_quant_group": lambda dt: torch.float8_e4m3fn,
    "fp8_block_matmul": lambda dt: _FLOAT[dt],
    "fp8_grouped_matmul": lambda dt: _FLOAT[dt],
    "fp8_indexer_logits": lambda dt: torch.float32,
    "fp8_indexer_topk": lambda dt: torch.int32,
    "fp8_mla_cache_quant": lambda dt: torch.uint8,
    "fp8_sparse_mla_attention": lambda dt: _FLOAT[dt],
}


def _layout(rows: int, paged: bool) -> SeqLayout:
    return SeqLayout.from_lengths([2], [rows], block_size=3 if paged else None)


def _paged(t: torch.Tensor, paged: bool) -> torch.Tensor:
    """[rows, ...] -> [ceil(rows/3), 3, ...] (consecutive blocks) when paged."""
    if not paged:
        return t
    pad = -t.shape[0] % 3
    t = torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) if pad else t
    return t.reshape(-1, 3, *t.shape[1:])


def fp8_sample(op: str, dt: str, layout_kind: str = "ragged") -> dict:
    g = torch.Generator().manual_seed(0)
    f = _FLOAT.get(dt, torch.float32)
    paged = layout_kind == "paged"
    if op == "fp8_quant_group":
        return dict(x=torch.randn(3, 200, generator=g).to(f), group_size=128, eps=1e-4, ue8m0=False)
    x_q, x_s = fp8_quant_group(torch.randn(3, 130, generator=g), 128, 1e-4, True)
    if op == "fp8_block_matmul":
        w_q, w_s = quantize_weight_blocks(torch.randn(5, 130, generator=g))
        return dict(x_q=x_q, x_scale=x_s, w_q=w_q, w_scale_inv=w_s, bias=None, out_dtype=f)
    if op == "fp8_grouped_matmul":
        w_q, w_s = quantize_weight_blocks(torch.randn(2, 5, 130, generator=g))
        offs = torch.tensor([0, 1, 3], dtype=torch.int32)
        return dict(x_q=x_q, x_scale=x_s, w_q=w_q, w_scale_inv=w_s, group_offsets=offs, out_dtype=f)
    if op in ("fp8_indexer_logits", "fp8_indexer_topk"):
        q8, k8, ks, w8 = quantize_indexer_inputs(
            torch.randn(2, 2, 32, generator=g),
            torch.randn(5, 32, generator=g),
            torch.randn(2, 2, generator=g),
        )
        a = dict(
            q=q8, k_cache=_paged(k8, paged), k_scale=_paged(ks, paged), weights=w8, layout=_layout(5, paged)
        )
        return a | ({"topk": 3} if op == "fp8_indexer_topk" else {})
    if op == "fp8_mla_cache_quant":
        return dict(kv=torch.randn(3, 576, generator=g).to(f))
    if op == "fp8_sparse_mla_attention":
        rows = fp8_mla_cache_quant(torch.randn(4, 576, generator=g) / 10)
        return dict(
            q=torch.randn(2, 2, 576, generator=g).to(f),
            kv_cache=_paged(rows, paged),
            indices=torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
            layout=_layout(4, paged),
            sm_scale=0.5,
            d_v=512,
            return_lse=True,
        )
    raise AssertionError(f"no sample for {op}")
