"""The ops of the contract (SPEC 2) as ONNX functions in the `glm5` domain.

Every body uses only standard ONNX operators of opset 18 (`ai.onnx`), so a toolchain that accepts
model-local functions runs them as they are, and one that does not runs `onnx.inliner.inline_local_functions`
first (docs/onnx.md). One file per op, as everywhere in the tree; `_layout.py` holds the SeqLayout
helpers the attention-like ops share.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from backends.onnxruntime.functions import (
    _layout,
    dynamic_quant_int8,
    grouped_matmul,
    indexer_logits,
    indexer_topk,
    linear_cross_entropy,
    silu_and_mul,
    sparse_mla_attention,
    topk,
    w4a8_matmul,
    w8a8_matmul,
)
from backends.onnxruntime.functions._opsets import DOMAIN, DOMAIN_VERSION, OPSET

_MODULES = (
    _layout,
    topk,
    indexer_logits,
    indexer_topk,
    sparse_mla_attention,
    dynamic_quant_int8,
    w8a8_matmul,
    w4a8_matmul,
    grouped_matmul,
    linear_cross_entropy,
    silu_and_mul,
)


def all_functions() -> dict:
    """name -> onnxscript OnnxFunction, for every function of the glm5 domain."""
    out = {}
    for mod in _MODULES:
        for obj in vars(mod).values():
            if (
                hasattr(obj, "to_function_proto")
                and getattr(obj, "opset", None) is not None
                and obj.opset.domain == DOMAIN
            ):
                out[obj.name] = obj
    return out


def _called(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if node.domain == DOMAIN:
            names.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= _called(attr.g.node)
            for g in attr.graphs:
                names |= _called(g.node)
    return names


def function_closure(names: Iterable[str]) -> list[onnx.FunctionProto]:
    """FunctionProtos of `names` and of every glm5 function they call, callees first."""
    fns = all_functions()
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name not in fns:
            raise KeyError(f"no ONNX function {DOMAIN}.{name}; known: {sorted(fns)}")
        for callee in sorted(_called(fns[name].to_function_proto().node)):
            visit(callee)
        order.append(name)

    for n in names:
        visit(n)
    return [fns[n].to_function_proto() for n in order]


__all__ = ["DOMAIN", "DOMAIN_VERSION", "OPSET", "all_functions", "function_closure"]
