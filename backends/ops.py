"""The ops of the contract (SPEC 2), their dtype axes and validators, in one table.

The conformance matrix's denominator is fixed by this table: every op x every value of its
dtype axis, whatever a backend claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backends import validation as v
from backends import validation_fp8 as v8

FLOATS = ("float32", "bfloat16", "float16")
FP8 = ("float8_e4m3fn",)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True)
class OpSpec:
    name: str
    spec_section: str
    dtype_axis: tuple[str, ...]
    dtype_of: Callable[[dict[str, Any]], str]
    validate: Callable[..., Any]  # shapes, dtypes, devices: every call, no host reads
    values: Callable[..., Any] | None = None  # value checks: once per layout, or per call in values mode
    cache_arg: str | None = None  # the argument indexed through a SeqLayout, if any
    #: arguments gradients flow to (the op is differentiable where a backend declares it)
    grad_args: tuple[str, ...] = ()


def _grouped_dtype(a: dict[str, Any]) -> str:
    if a["x"].dtype == torch.int8:
        return "w8a8" if a["w"].dtype == torch.int8 else "w4a8"
    return dtype_name(a["x"].dtype)


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec(
            "indexer_logits",
            "2.1",
            FLOATS,
            lambda a: dtype_name(a["q"].dtype),
            v.check_indexer_logits,
            v.values_indexer_logits,
            "k_cache",
            ("q", "k_cache", "weights"),
        ),
        OpSpec(
            "indexer_topk",
            "2.2",
            FLOATS,
            lambda a: dtype_name(a["q"].dtype),
            v.check_indexer_topk,
            v.values_indexer_topk,
            "k_cache",
        ),
        OpSpec("topk", "2.3", FLOATS, lambda a: dtype_name(a["x"].dtype), v.check_topk, v.values_topk),
        OpSpec(
            "sparse_mla_attention",
            "2.4",
            FLOATS,
            lambda a: dtype_name(a["q"].dtype),
            v.check_sparse_mla_attention,
            v.values_sparse_mla_attention,
            "kv_cache",
            ("q", "kv_cache"),
        ),
        OpSpec(
            "dynamic_quant_int8",
            "2.5",
            FLOATS,
            lambda a: dtype_name(a["x"].dtype),
            v.check_dynamic_quant_int8,
        ),
        OpSpec("w8a8_matmul", "2.6", FLOATS, lambda a: dtype_name(a["out_dtype"]), v.check_w8a8_matmul),
        OpSpec("w4a8_matmul", "2.7", FLOATS, lambda a: dtype_name(a["out_dtype"]), v.check_w4a8_matmul),
        OpSpec(
            "grouped_matmul",
            "2.8",
            FLOATS + ("w8a8", "w4a8"),
            _grouped_dtype,
            v.check_grouped_matmul,
            v.values_grouped_matmul,
            grad_args=("x", "w"),  # the float variant (integer tensors carry no gradient)
        ),
        OpSpec(
            "linear_cross_entropy",
            "2.9",
            FLOATS,
            lambda a: dtype_name(a["h"].dtype),
            v.check_linear_cross_entropy,
            v.values_linear_cross_entropy,
            grad_args=("h", "weight"),
        ),
        # FP8 (SPEC 7): forward-only ops, served where an FP8 datapath exists (validators: validation_fp8)
        OpSpec(
            "fp8_quant_group", "7.1", FLOATS, lambda a: dtype_name(a["x"].dtype), v8.check_fp8_quant_group
        ),
        OpSpec(
            "fp8_block_matmul",
            "7.2",
            FLOATS,
            lambda a: dtype_name(a["out_dtype"]),
            v8.check_fp8_block_matmul,
        ),
        OpSpec(
            "fp8_grouped_matmul",
            "7.3",
            FLOATS,
            lambda a: dtype_name(a["out_dtype"]),
            v8.check_fp8_grouped_matmul,
            v8.values_fp8_grouped_matmul,
        ),
        OpSpec(
            "fp8_indexer_logits",
            "7.4",
            FP8,
            lambda a: dtype_name(a["q"].dtype),
            v8.check_fp8_indexer_logits,
            v8.values_fp8_indexer_logits,
            "k_cache",
        ),
        OpSpec(
            "fp8_indexer_topk",
            "7.5",
            FP8,
            lambda a: dtype_name(a["q"].dtype),
            v8.check_fp8_indexer_topk,
            v8.values_fp8_indexer_topk,
            "k_cache",
        ),
        OpSpec(
            "fp8_mla_cache_quant",
            "7.6",
            FLOATS,
            lambda a: dtype_name(a["kv"].dtype),
            v8.check_fp8_mla_cache_quant,
        ),
        OpSpec(
            "fp8_sparse_mla_attention",
            "7.7",
            FLOATS,
            lambda a: dtype_name(a["q"].dtype),
            v8.check_fp8_sparse_mla_attention,
            v8.values_fp8_sparse_mla_attention,
            "kv_cache",
        ),
    )
}

OP_NAMES: tuple[str, ...] = tuple(OPS)
