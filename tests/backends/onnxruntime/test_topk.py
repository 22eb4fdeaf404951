"""topk on ONNX Runtime: where ORT's own TopK deviates from SPEC 2.3 (NaN first) the function's rank
key corrects it; its lower-index tie rule is relied on at sizes where ORT switches algorithms."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

NAN, INF = float("nan"), float("inf")


def _raw_ort_topk(x: np.ndarray, k: int) -> np.ndarray:
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], largest=1, sorted=1)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["r", "c"]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["r", "k"]),
            helper.make_tensor_value_info("i", TensorProto.INT64, ["r", "k"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "k": np.array([k])})[1]


def test_raw_ort_ranks_nan_first_the_function_ranks_it_last(be, ref, no_fallback):
    x = torch.tensor([[1.0, NAN, -INF, 2.0, NAN, -INF, 0.0]])
    assert _raw_ort_topk(x.numpy(), 2).tolist() == [[1, 4]]  # why rank_key exists
    values, indices = be.topk(x, 7)
    assert indices.tolist() == [[3, 0, 6, 2, 5, 1, 4]]
    assert torch.equal(indices, ref.topk(x, 7)[1])
    no_fallback(ref_calls_allowed=1)


def test_large_rows_with_many_ties_match_the_rule_bitwise(be, ref):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (3, 20000), generator=g).float()
    x[1, ::5] = -0.0
    x[2, 100:] = float("-inf")
    v, i = be.topk(x, 2048)
    rv, ri = ref.topk(x, 2048)
    assert torch.equal(i, ri)
    assert torch.equal(v.view(torch.int32), rv.view(torch.int32))


def test_values_are_the_input_bits(be, ref):
    """Values are gathered, never cast or computed: -0.0 stays -0.0 and a NaN keeps its payload."""
    x = torch.tensor([[-0.0, 0.0, -0.0, NAN, 1.5]], dtype=torch.bfloat16)
    x.view(torch.int16)[0, 3] = 0x7FC5  # a NaN with a payload
    v, i = be.topk(x, 5)
    assert torch.equal(i, ref.topk(x, 5)[1])
    assert torch.equal(v.view(torch.int16), x.view(torch.int16).gather(1, i.long()))


def test_k_beyond_columns_and_zero_lengths_pad(be):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float16)
    v, i = be.topk(x, 5, torch.tensor([2, 0], dtype=torch.int32))
    assert i.tolist() == [[1, 0, -1, -1, -1], [-1] * 5]
    assert v.dtype == torch.float16 and torch.isinf(v[0, 2:]).all() and torch.isinf(v[1]).all()


def test_batch_invariant_bitwise(be):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (64, 300), generator=g).float()
    full = be.topk(x, 40)[1]
    assert torch.equal(be.topk(x[17:18], 40)[1], full[17:18])
