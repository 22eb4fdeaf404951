"""The `reference` backend: the contract (SPEC 2) in plain fp32 torch on the CPU.

Every other backend is checked against it. Which file serves which op:
"""

from __future__ import annotations

import platform

import torch

from backends.caps import OpCaps, OpImpl
from backends.interface import Backend
from backends.ops import FLOATS
from backends.reference import (
    dynamic_quant_int8,
    grouped_matmul,
    indexer_logits,
    indexer_topk,
    linear_cross_entropy,
    sparse_mla_attention,
    topk,
    w4a8_matmul,
    w8a8_matmul,
)

_LAYOUTS = ("ragged", "paged")


class ReferenceBackend(Backend):
    name = "reference"
    device = "cpu"
    ops = {
        "indexer_logits": OpImpl(
            indexer_logits.indexer_logits, OpCaps(FLOATS, _LAYOUTS, differentiable=True)
        ),
        "indexer_topk": OpImpl(indexer_topk.indexer_topk, OpCaps(FLOATS, _LAYOUTS, tie_rule="lower_index")),
        "topk": OpImpl(topk.topk, OpCaps(FLOATS, tie_rule="lower_index")),
        "sparse_mla_attention": OpImpl(
            sparse_mla_attention.sparse_mla_attention, OpCaps(FLOATS, _LAYOUTS, differentiable=True)
        ),
        "dynamic_quant_int8": OpImpl(dynamic_quant_int8.dynamic_quant_int8, OpCaps(FLOATS)),
        "w8a8_matmul": OpImpl(w8a8_matmul.w8a8_matmul, OpCaps(FLOATS)),
        "w4a8_matmul": OpImpl(w4a8_matmul.w4a8_matmul, OpCaps(FLOATS)),
        "grouped_matmul": OpImpl(grouped_matmul.grouped_matmul, OpCaps(FLOATS + ("w8a8", "w4a8"))),
        "linear_cross_entropy": OpImpl(
            linear_cross_entropy.linear_cross_entropy, OpCaps(FLOATS, differentiable=True)
        ),
    }

    def environment(self) -> dict[str, str]:
        return {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
