"""An FP8 copy of a GLM-5 model for RL rollouts: what an FP8 inference engine runs (GLM-5-FP8 on H200),
next to the bf16 model that training differentiates.

`fp8_policy(model)` deep-copies the model, block-quantizes every linear and routed-expert weight the
published FP8 checkpoints store in FP8 (quant/formats/fp8.py; kv_b_proj de-quantized again, as loaders
do), and gives the copy an `FP8AttentionBackend`: the model's own backend with the indexer and the sparse
attention served in FP8 (SPEC 7.4-7.7):
  indexer_topk / indexer_logits -> q per head and the key cache per key quantized to e4m3 with UE8M0
      scales, the q scale folded into the head weights, then fp8_indexer_topk / fp8_indexer_logits;
  sparse_mla_attention -> the latent cache in FlashMLA's 656-byte rows (fp8_mla_cache_quant +
      fp8_sparse_mla_attention) when the model has GLM-5's widths (512 latent + 64 RoPE); for other widths
      (tiny test models) the same numerics simulated: each latent row quantized in tiles of min(128, d_v)
      with FlashMLA's power-of-two scales and de-quantized, the RoPE part rounded to bf16 (as DeepSeek's
      V3.2 demo simulates its FP8 cache), then the model's sparse_mla_attention.
Quantizing the cache at each call gives the same values as quantizing rows once when they are written
(the quantization is per row), at the cost of re-doing it; this copy is for checks, not throughput.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from backends import Backend
from backends.formats import (
    E4M3_MAX,
    MLA_SCALE_FLOOR,
    cast_e4m3,
    dequantize_weight_blocks,
    pow2_ceil,
    quantize_indexer_inputs,
    quantize_weight_blocks,
)
from glm5.moe import Experts
from quant.formats.fp8 import DEQUANT_AT_LOAD, _matches, fp8_targets
from quant.fp8_modules import EXPERT_PROJS, FP8Experts, FP8Linear


def fake_quant_latent(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """FlashMLA cache numerics for any width: latent kv[..., :d_v] in tiles of min(128, d_v) as e4m3 with
    scale 2^ceil(log2(max(amax/448, 1e-4))) de-quantized and rounded to bf16; the rest rounded to bf16."""
    tile = min(128, d_v)
    lat = kv[..., :d_v].float()
    shape = lat.shape
    t = lat.reshape(*shape[:-1], -1, tile)
    s = pow2_ceil(torch.clamp(t.abs().amax(dim=-1, keepdim=True) / E4M3_MAX, min=MLA_SCALE_FLOOR))
    deq = (cast_e4m3(t / s).float() * s).bfloat16().float().reshape(shape)
    return torch.cat([deq, kv[..., d_v:].bfloat16().float()], dim=-1)


class FP8AttentionBackend(Backend):
    """The inner backend with the indexer and sparse attention in FP8; every other op is the inner
    backend's implementation (its op table, run through this front door). Records the indexer's selections
    (`selections[i]` = the i-th indexer_topk call's indices) for overlap statistics."""

    def __init__(self, inner: Backend, fp8: bool = True) -> None:
        self.inner, self.fp8 = inner, fp8
        self.name, self.device, self.ops = inner.name, inner.device, inner.ops
        super().__init__()
        self.selections: list[torch.Tensor] = []
        self.fp8_calls: defaultdict[str, int] = defaultdict(int)

    def available(self) -> tuple[bool, str]:
        return self.inner.available()

    def kernel_calls(self):
        return self.inner.kernel_calls() + self.calls

    def environment(self) -> dict[str, str]:
        return self.inner.environment()

    def _fp8_indexer(self, q, k_cache, weights):
        d = k_cache.shape[-1]
        q8, k8, ks, w8 = quantize_indexer_inputs(q, k_cache.reshape(-1, d), weights)
        return q8, k8.reshape(k_cache.shape), ks.reshape(k_cache.shape[:-1]), w8

    def indexer_topk(self, q, k_cache, weights, layout, topk):
        if self.fp8:
            self.fp8_calls["fp8_indexer_topk"] += 1
            out = self.inner.fp8_indexer_topk(*self._fp8_indexer(q, k_cache, weights), layout, topk)
        else:
            out = self.inner.indexer_topk(q, k_cache, weights, layout, topk)
        self.selections.append(out.detach().cpu())
        return out

    def indexer_logits(self, q, k_cache, weights, layout):
        if not self.fp8:
            return self.inner.indexer_logits(q, k_cache, weights, layout)
        self.fp8_calls["fp8_indexer_logits"] += 1
        return self.inner.fp8_indexer_logits(*self._fp8_indexer(q, k_cache, weights), layout)

    def sparse_mla_attention(self, q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        if not self.fp8:
            return self.inner.sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse)
        if kv_cache.shape[-1] == 576 and d_v == 512:
            self.fp8_calls["fp8_sparse_mla_attention"] += 1
            rows = self.inner.fp8_mla_cache_quant(kv_cache.reshape(-1, 576)).reshape(
                *kv_cache.shape[:-1], 656
            )
            return self.inner.fp8_sparse_mla_attention(q, rows, indices, layout, sm_scale, d_v, return_lse)
        self.fp8_calls["simulated_fp8_cache"] += 1
        deq = fake_quant_latent(kv_cache, d_v).to(kv_cache.dtype)
        return self.inner.sparse_mla_attention(q, deq, indices, layout, sm_scale, d_v, return_lse)


@torch.no_grad()
def to_fp8_modules(model: nn.Module, backend: Any, ue8m0: bool = False) -> nn.Module:
    """Swap the FP8 targets of `model` (in place) for FP8Linear / FP8Experts with block-quantized weights."""
    for name, mod in fp8_targets(model):
        if isinstance(mod, (FP8Linear, FP8Experts)):
            continue
        if _matches(name, DEQUANT_AT_LOAD):  # stored FP8, used de-quantized
            mod.weight.copy_(
                dequantize_weight_blocks(*quantize_weight_blocks(mod.weight.cpu())).to(mod.weight)
            )
            continue
        dev = next(mod.parameters()).device
        if isinstance(mod, nn.Linear):
            new = FP8Linear(mod.in_features, mod.out_features, backend, mod.bias is not None, ue8m0, dev)
            q, s = quantize_weight_blocks(mod.weight.cpu())
            new.set_fp8(q.to(dev), s.to(dev), None if mod.bias is None else mod.bias)
        elif isinstance(mod, Experts):
            e, i, d = mod.gate_proj.shape
            new = FP8Experts(e, d, i, ue8m0, dev)
            for j in range(e):
                for p in EXPERT_PROJS:
                    q, s = quantize_weight_blocks(getattr(mod, p)[j].cpu())
                    new.set_fp8(j, p, q.to(dev), s.to(dev))
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model


def fp8_policy(model: nn.Module) -> nn.Module:
    """A copy of `model` with FP8 linears and experts and the FP8 attention backend (`.backend`)."""
    # a fresh model with copied weights (a trained model may hold hooks and graph tensors deepcopy refuses)
    with torch.device("meta"):
        m = type(model)(model.config, backend=model.backend, dtype=model.dtype)
    m.to_empty(device=model.backend.device)
    m.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    m.backend = FP8AttentionBackend(fp8_backend(model.backend))
    return to_fp8_modules(m, m.backend).eval()


def fp8_backend(be: Any) -> Any:
    """`be` itself if it serves every FP8 op the policy calls (cuda, cpu, the reference), else the reference
    backend: named, not silent (the rollout check reports `fp8_backend` with the reason), for a backend
    with no FP8 datapath to sample with (Ascend A2/A3)."""
    import backends

    return be if all(be.capabilities(op) for op in FP8_OPS) else backends.get("reference")


FP8_OPS = (
    "fp8_quant_group",
    "fp8_block_matmul",
    "fp8_grouped_matmul",
    "fp8_indexer_topk",
    "fp8_mla_cache_quant",
    "fp8_sparse_mla_attention",
)
