"""The glm5 ONNX functions as artefacts: standard operators only, checker-clean, inlinable."""

from __future__ import annotations

import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch

from backends.onnxruntime import _session
from backends.onnxruntime.functions import DOMAIN, OPSET, all_functions, function_closure

TOP_LEVEL = [
    "topk",
    "topk_lengths",
    "indexer_logits_ragged",
    "indexer_logits_paged",
    "indexer_topk_ragged",
    "indexer_topk_paged",
    "sparse_mla_attention_ragged",
    "sparse_mla_attention_paged",
    "dynamic_quant_int8",
    "w8a8_matmul",
    "w8a8_matmul_bias",
    "w4a8_matmul",
    "w4a8_matmul_bias",
    "grouped_matmul",
    "grouped_matmul_w8a8",
    "grouped_matmul_w4a8",
    "linear_cross_entropy",
]


def _nodes(nodes):
    for n in nodes:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g.node)


def test_every_op_has_its_functions():
    names = set(all_functions())
    assert set(TOP_LEVEL) <= names


@pytest.mark.parametrize("name", sorted(all_functions()))
def test_body_uses_only_standard_opset_operators(name):
    fp = all_functions()[name].to_function_proto()
    assert fp.domain == DOMAIN
    assert {o.domain: o.version for o in fp.opset_import}.get("", OPSET) == OPSET
    for node in _nodes(fp.node):
        if node.domain == DOMAIN:
            assert node.op_type in all_functions(), f"{name} calls unknown glm5.{node.op_type}"
            continue
        assert node.domain in ("", "ai.onnx"), f"{name}: {node.domain}.{node.op_type} is not standard ONNX"
        schema = onnx.defs.get_schema(node.op_type, OPSET, "")
        assert not schema.deprecated, f"{name}: {node.op_type} is deprecated in opset {OPSET}"


def test_closure_lists_callees_before_callers():
    protos = function_closure(["indexer_topk_paged"])
    names = [p.name for p in protos]
    assert names[-1] == "indexer_topk_paged"
    for i, p in enumerate(protos):
        for node in _nodes(p.node):
            if node.domain == DOMAIN:
                assert node.op_type in names[:i], f"{p.name} calls {node.op_type} before its definition"


def test_indexer_topk_scores_in_a_loop():
    """SPEC 2.2: the [T, S] logits must not be materialised; scoring and TopK live in the Loop body."""
    fp = all_functions()["indexer_topk_rows"].to_function_proto()
    loops = [n for n in fp.node if n.op_type == "Loop"]
    assert len(loops) == 1
    body = {n.op_type for n in loops[0].attribute[0].g.node}
    assert {"TopK", "score_positions"} <= body


def _topk_model(k: int) -> onnx.ModelProto:
    return _session.build_model(
        "topk_lengths",
        [("x", torch.float32, 2), ("lengths", torch.int64, 1)],
        [("values", torch.float32, 2), ("indices", torch.int32, 2)],
        {"k": k},
    )


def test_model_passes_full_check_and_inlines_to_standard_onnx():
    model = _topk_model(5)
    onnx.checker.check_model(model, full_check=True)
    flat = onnx.inliner.inline_local_functions(model)
    assert len(flat.functions) == 0
    assert all(n.domain in ("", "ai.onnx") for n in _nodes(flat.graph.node))
    onnx.checker.check_model(flat, full_check=True)
    x = torch.tensor([[3.0, float("nan"), 3.0, float("-inf"), 7.0, -0.0, 0.0]])
    lengths = torch.tensor([7])
    feeds = {"x": x.numpy(), "lengths": lengths.numpy()}
    outs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        for m in (model, flat)
    ]
    assert outs[0][1].tolist() == outs[1][1].tolist() == [[4, 0, 2, 5, 6]]


def test_sessions_are_cached_per_dtype_and_attributes(be):
    x = torch.randn(3, 8)
    be.topk(x, 2)
    n = len(_session._sessions)
    be.topk(x * 2, 2)
    assert len(_session._sessions) == n
    be.topk(x, 3)
    be.topk(x.half(), 3)
    assert len(_session._sessions) == n + 2
