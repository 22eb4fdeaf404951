"""The onnxruntime backend as a registry entry: available, declares its caps, counts session runs,
refuses with reasons what ONNX Runtime cannot do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import backends
from backends import NotSupported, SeqLayout
from backends.contract.ops import OP_NAMES


def test_registered_and_available(be):
    assert be.name == "onnxruntime"
    assert ("onnxruntime", True) == next((n, ok) for n, ok, _ in backends.available() if n == "onnxruntime")
    env = be.environment()
    assert env["opset"] == "18" and env["onnxruntime"]


def test_every_op_is_served(be):
    # every op but the FP8 family (SPEC 7), which needs an FP8 datapath, and linear_cross_entropy_shard
    # (2.9.1, a training op; this backend is inference only)
    absent = ("linear_cross_entropy_shard",)
    assert set(be.ops) == {op for op in OP_NAMES if not op.startswith("fp8_") and op not in absent}
    assert be.capabilities("topk").tie_rule == "lower_index"
    assert be.capabilities("indexer_topk").tie_rule == "lower_index"
    assert not any(be.capabilities(op).differentiable for op in be.ops)


def test_kernel_calls_count_session_runs_not_reference(be, no_fallback):
    before = be.kernel_calls()["dynamic_quant_int8"]
    be.dynamic_quant_int8(torch.randn(4, 16))
    assert be.kernel_calls()["dynamic_quant_int8"] == before + 1
    no_fallback()


@pytest.mark.parametrize("op", ["indexer_logits", "sparse_mla_attention"])
def test_requires_grad_is_refused_with_a_reason(be, op):
    lay = SeqLayout.from_lengths([2], [5])
    q = torch.randn(2, 2, 8, requires_grad=True)
    cache = torch.randn(5, 8)
    with pytest.raises(NotSupported, match="inference only"):
        if op == "indexer_logits":
            be.indexer_logits(q, cache, torch.randn(2, 2), lay)
        else:
            be.sparse_mla_attention(q, cache, torch.zeros(2, 3, dtype=torch.int32), lay, 0.1, 4)


def test_linear_cross_entropy_with_grad_is_refused(be):
    h = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(NotSupported, match="no backward"):
        be.linear_cross_entropy(h, torch.randn(5, 4), torch.tensor([0, 1, 2]))


def test_int32_overflow_limit_is_declared(be):
    k = 131072 + 2
    x_q = torch.full((1, k), -128, dtype=torch.int8)
    w_q = torch.full((1, k), -128, dtype=torch.int8)
    with pytest.raises(NotSupported, match="int32 accumulator"):
        be.w8a8_matmul(x_q, torch.ones(1), w_q, torch.ones(1))


def test_bad_input_is_a_value_error_naming_the_argument(be):
    with pytest.raises(ValueError, match="^x: expected"):
        be.topk(torch.randn(3), 2)


def test_missing_dependency_is_reported_not_raised():
    code = (
        "import sys; sys.modules['onnxruntime'] = None\n"
        "import backends\n"
        "print([r for n, ok, r in backends.available() if n == 'onnxruntime'][0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "onnxruntime is not installed; pip install 'glm5-backends[onnx]'" in out.stdout


def test_weights_that_require_grad_are_served_under_no_grad(be):
    lay = SeqLayout.from_lengths([2], [5])
    q = torch.randn(2, 2, 8, requires_grad=True)
    with torch.no_grad():
        out = be.indexer_logits(q, torch.randn(5, 8), torch.randn(2, 2), lay)
    assert out.shape == (2, 5) and not out.requires_grad
