"""An FP8 copy of a GLM-5 model for RL rollouts: what an FP8 inference engine runs (GLM-5-FP8 on H200),
next to the bf16 model that training differentiates.

`fp8_policy(model)` deep-copies the model, block-quantizes every linear and routed-expert weight the
published FP8 checkpoints store in FP8 (quant/formats/fp8.py; kv_b_proj de-quantized again, as loaders
do), and gives the copy a view of the model's own backend with the `FP8Attention` hook installed
(`Backend.with_hooks`, backends/hooks.py): a front-door override that serves the indexer and the sparse
attention in FP8 (SPEC 7.4-7.7):
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
from backends.hooks import NOT_OVERRIDDEN, Hook
from glm5.core.moe import Experts
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


def _fp8_indexer(q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor) -> tuple:
    d = k_cache.shape[-1]
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k_cache.reshape(-1, d), weights)
    return q8, k8.reshape(k_cache.shape), ks.reshape(k_cache.shape[:-1]), w8


class FP8Attention(Hook):
    """The front-door override (backends/hooks.py) that serves the indexer and the sparse attention in
    FP8 with the hooked backend's own FP8 ops; every other op is the backend's. `fp8_calls` counts which
    FP8 path served each overridden call."""

    def __init__(self) -> None:
        self.fp8_calls: defaultdict[str, int] = defaultdict(int)

    def override(self, backend: Backend, op: str, args: dict[str, Any]) -> Any:
        if op == "indexer_topk":
            self.fp8_calls["fp8_indexer_topk"] += 1
            quantized = _fp8_indexer(args["q"], args["k_cache"], args["weights"])
            return backend.fp8_indexer_topk(*quantized, args["layout"], args["topk"])
        if op == "indexer_logits":
            self.fp8_calls["fp8_indexer_logits"] += 1
            quantized = _fp8_indexer(args["q"], args["k_cache"], args["weights"])
            return backend.fp8_indexer_logits(*quantized, args["layout"])
        if op != "sparse_mla_attention":
            return NOT_OVERRIDDEN
        kv, d_v = args["kv_cache"], args["d_v"]
        rest = (args["indices"], args["layout"], args["sm_scale"], d_v, args["return_lse"])
        if kv.shape[-1] == 576 and d_v == 512:
            self.fp8_calls["fp8_sparse_mla_attention"] += 1
            rows = backend.fp8_mla_cache_quant(kv.reshape(-1, 576)).reshape(*kv.shape[:-1], 656)
            return backend.fp8_sparse_mla_attention(args["q"], rows, *rest)
        self.fp8_calls["simulated_fp8_cache"] += 1
        return backend.sparse_mla_attention(args["q"], fake_quant_latent(kv, d_v).to(kv.dtype), *rest)


def fp8_attention(backend: Backend) -> FP8Attention:
    """The FP8Attention hook installed on `backend` (a policy's backend from `fp8_policy`)."""
    for hook in backend.hooks:
        if isinstance(hook, FP8Attention):
            return hook
    raise ValueError(f"backend: expected one with the FP8Attention hook (fp8_policy's), got {backend!r}")


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
    """A copy of `model` with FP8 linears and experts, its backend a view with the FP8Attention hook."""
    # a fresh model with copied weights (a trained model may hold hooks and graph tensors deepcopy refuses)
    with torch.device("meta"):
        m = type(model)(model.config, backend=model.backend, dtype=model.dtype)
    m.to_empty(device=model.backend.device)
    m.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    m.backend = fp8_backend(model.backend).with_hooks(FP8Attention())
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
