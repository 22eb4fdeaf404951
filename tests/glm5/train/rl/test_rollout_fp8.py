"""The FP8 rollout check (glm5/train/rl/rollout.py, quant/fp8.py): FP8 linears, the FP8 indexer and the FP8
latent cache really run in the rollout, the bf16 recompute differs from it, and the statistics IcePop
needs come out (ratio band, popped share, top-k set overlap)."""

from __future__ import annotations

import pytest
import torch

from backends.cache_layout import cache_kind
from backends.hooks import Hook
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.rl.rollout import rollout_check
from quant.fp8 import fp8_policy
from quant.fp8_modules import FP8Experts, FP8Linear
from tests.quant.conftest import ids, tiny_model


def test_fp8_policy_swaps_modules_and_keeps_the_source():
    m = tiny_model()
    p = fp8_policy(m)
    assert isinstance(p.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert isinstance(p.model.layers[1].mlp.experts, FP8Experts)
    assert isinstance(m.model.layers[0].self_attn.q_a_proj, torch.nn.Linear)  # the bf16 model is untouched
    assert not isinstance(p.model.layers[0].self_attn.indexer.weights_proj, FP8Linear)  # bf16 as published


class Kinds(Hook):
    """The cache kinds each op was given."""

    def __init__(self) -> None:
        self.seen: dict[str, set] = {}

    def observe(self, backend, op, args, out) -> None:
        self.seen.setdefault(op, set()).add(cache_kind(args))


def _kinds(policy, cached: bool) -> dict[str, set]:
    with policy.backend.hooked(Kinds()) as k, torch.no_grad():
        policy(ids(1, 6), policy.new_cache(1, 8, block_size=4) if cached else None)
    return k.seen


def test_the_policy_keeps_fp8_caches_and_its_backend_unhooked():
    """No override: the policy calls the model's ops on FP8 caches, whose kind picks the FP8 kernels."""
    m = tiny_model()
    p = fp8_policy(m)
    assert p.backend.hooks == () and m.kv_cache_dtype == "auto" and p.kv_cache_dtype == "fp8_ds_mla"
    cache = p.new_cache(1, 8)
    assert cache.index_k[0].dtype == torch.uint8 and cache.kv[0].dtype == m.dtype  # tiny widths: simulated
    assert _kinds(p, cached=False)["indexer_topk"] == {"fp8_ragged"}
    seen = _kinds(p, cached=True)
    assert seen["indexer_topk"] == {"fp8_paged"} and seen["sparse_mla_attention"] == {"paged"}


def test_fp8_rollout_statistics_on_the_simulated_cache():
    r = rollout_check(tiny_model(), ids(2, 24), 6, invariant=False, rollout_precision="fp8")
    assert r["fp8_cache"]["latent"].startswith("simulated")
    assert not r["bitwise_equal"] and r["max_abs_logprob_diff"] > 1e-4
    assert 0 < r["ratio_min"] <= 1 <= r["ratio_max"] and 0 <= r["outside_half_to_two"] <= 1
    assert 0.5 < r["topk_overlap"] <= 1.0


def test_fp8_rollout_uses_the_656_byte_cache_at_glm5_widths():
    cfg = GLM5Config.from_preset("tiny", kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
    m = GLM5ForCausalLM(cfg, backend="reference")
    m.init_weights(0)
    r = rollout_check(m.eval(), ids(1, 20), 3, invariant=False, rollout_precision="fp8")
    assert r["fp8_cache"]["latent"] == "656-byte rows"
    seen = _kinds(fp8_policy(m), cached=True)
    assert seen["sparse_mla_attention"] == {"fp8_paged"} and seen["indexer_topk"] == {"fp8_paged"}


def test_simulated_cache_matches_the_656_byte_rows():
    from backends.formats import mla_simulated_rows
    from backends.reference.fp8_format import mla_dequantize_rows
    from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant

    kv = (torch.randn(7, 576, generator=torch.Generator().manual_seed(0)) / 10).bfloat16()
    assert torch.equal(mla_simulated_rows(kv, 512), mla_dequantize_rows(fp8_mla_cache_quant(kv)))


def test_rejects_an_unknown_precision():
    with pytest.raises(ValueError, match="rollout_precision: expected one of"):
        rollout_check(tiny_model(), ids(1, 8), 1, rollout_precision="fp4")
