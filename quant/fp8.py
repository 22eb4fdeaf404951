"""An FP8 copy of a GLM-5 model for RL rollouts: what an FP8 inference engine runs (GLM-5-FP8 on H200),
next to the bf16 model that training differentiates.

`fp8_policy(model)` copies the model, block-quantizes every linear and routed-expert weight the published
FP8 checkpoints store in FP8 (quant/formats/fp8.py; kv_b_proj de-quantized again, as loaders do), and
keeps its caches in FP8 (`kv_cache_dtype = "fp8_ds_mla"`, glm5/core/cache.py `CacheFormat`): latent rows
as FlashMLA's 656-byte rows where the model has GLM-5's widths (512 latent + 64 RoPE; for other widths,
tiny test models, the same numerics simulated in the model dtype), indexer keys as the FP8 indexer cache.
Rows are quantized once, when written; `sparse_mla_attention` and `indexer_topk` read the cache they are
given, whose kind picks the backend's FP8 kernel (SPEC 7.8), with no override of the model's calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backends.cache_layout import FP8_KINDS
from backends.formats import dequantize_weight_blocks, quantize_weight_blocks
from glm5.core.cache import FP8_DS_MLA
from glm5.core.moe import Experts
from quant.formats.fp8 import DEQUANT_AT_LOAD, _matches, fp8_targets
from quant.fp8_modules import EXPERT_PROJS, FP8Experts, FP8Linear


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
    """A copy of `model` with FP8 linears and experts and FP8 caches (on `fp8_backend(model.backend)`)."""
    # a fresh model with copied weights (a trained model may hold hooks and graph tensors deepcopy refuses)
    with torch.device("meta"):
        m = type(model)(model.config, backend=model.backend, dtype=model.dtype)
    m.to_empty(device=model.backend.device)
    m.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    m.backend = fp8_backend(model.backend)
    m.kv_cache_dtype = FP8_DS_MLA
    return to_fp8_modules(m, m.backend).eval()


def fp8_backend(be: Any) -> Any:
    """`be` itself if it serves every FP8 op and FP8 cache kind the policy uses (cuda, cpu, the reference),
    else the reference backend: named, not silent (the rollout check reports `fp8_backend` with the
    reason), for a backend with no FP8 datapath to sample with (Ascend A2/A3)."""
    import backends

    def serves(op: str) -> bool:
        caps = be.capabilities(op)
        return caps is not None and (op not in FP8_CACHE_OPS or set(FP8_KINDS) <= set(caps.layouts))

    return be if all(serves(op) for op in FP8_OPS + FP8_CACHE_OPS) else backends.get("reference")


FP8_OPS = ("fp8_quant_group", "fp8_block_matmul", "fp8_grouped_matmul", "fp8_mla_cache_quant")
#: the ops that read the FP8 caches (their FP8 kinds, SPEC 7.8)
FP8_CACHE_OPS = ("sparse_mla_attention", "indexer_topk")
