"""`torch.export` traces the model's prefill on the reference backend: every backend op is one
`torch.ops.glm5.<op>` node (no graph break, no host read of a layout), and the exported program runs
the same computation as the eager model. The ONNX export (glm5/onnx_export) is built on this program."""

from __future__ import annotations

from collections import Counter

import torch

from glm5.onnx_export.program import trace_prefill
from tests.glm5._util import random_ids

B, S = 2, 40


def _glm5_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [
        n
        for n in program.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "glm5"
    ]


def test_prefill_traces_with_each_backend_op_as_one_custom_op_node(tiny):
    cfg = tiny.config
    assert S > cfg.index_topk  # DSA is really sparse at this length
    program = trace_prefill(tiny, B, S)
    nodes = _glm5_nodes(program)
    calls = Counter(n.target.name() for n in nodes)
    full = cfg.indexer_types.count("full")
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert calls["glm5::indexer_topk"] == full
    assert calls["glm5::sparse_mla_attention"] == cfg.num_hidden_layers
    assert calls["glm5::grouped_matmul"] == 3 * moe  # gate, up, down
    assert calls["glm5::topk"] >= moe  # router top-k (plus the group top-k)
    # one per layer's MLP (dense, or the routed experts) and one per MoE layer's shared expert
    assert calls["glm5::silu_and_mul"] == cfg.num_hidden_layers + moe * bool(cfg.n_shared_experts)
    assert set(calls) == {
        "glm5::indexer_topk",
        "glm5::sparse_mla_attention",
        "glm5::grouped_matmul",
        "glm5::topk",
        "glm5::silu_and_mul",
    }
    # the backend is reached by its key, the last argument of every node
    assert {n.args[-1] for n in nodes} == {tiny.backend.key}
    # nothing read a value back to the host while tracing (a layout check would have)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("_local_scalar_dense" in t for t in targets)


def test_exported_prefill_computes_the_eager_logits(tiny):
    program = trace_prefill(tiny, B, S)
    ids = random_ids(B, S, tiny.config.vocab_size, seed=5)
    calls_before = tiny.backend.calls["sparse_mla_attention"]
    with torch.no_grad():
        got = program.module()(ids)
        want = tiny(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the program ran the reference backend's ops (once per layer), not a traced-in copy of them
    assert tiny.backend.calls["sparse_mla_attention"] - calls_before == 2 * tiny.config.num_hidden_layers
