"""`Glm5BackendsMTP`: vLLM's MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) drafted by
the project's own MTP layer on the GLM-5 backend.

vLLM drafts GLM-5's MTP as a `deepseek_mtp` model (its `DeepseekV32MTPModel`, built on vLLM's own DSA
kernels). For `Glm5BackendsForCausalLM` the plugin's config hook points the draft at this class instead
(`use_project_mtp`), so `--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'` needs nothing
else. The draft is the project's `MTPLayer` (glm5/core/model.py) with its own paged latent and indexer caches
in vLLM's pool; draft j > 1 chains the MTP layer on its own output (the pre-norm hidden state), exactly as
`glm5.generate.generate_speculative` does, so vLLM accepts the drafts `glm5 generate --mtp N` accepts.

The draft is split as the target is: the one parallel plan (glm5/parallel/plan.py) over vLLM's groups, and
a float checkpoint's MTP tensors come through vLLM's weight iterator, each rank keeping its slice
(glm5/weights/load.py). It holds only the MTP layers: the embedding and the output head are the target's,
which vLLM hands the draft (`embed_tokens` through the target's `model`, `lm_head` directly), split by the
same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform

import backends
from glm5.core.attention import Step
from glm5.core.cache import StepSlots
from glm5.core.checkpoint import read_config
from glm5.core.config import GLM5Config
from glm5.core.layers import rope_angles
from glm5.core.model import GLM5ForCausalLM
from glm5.loader import is_quantized
from glm5.parallel.plan import apply
from glm5.parallel.plan import check as check_plan
from glm5.vllm.cache import Glm5CacheLayer
from glm5.vllm.fp8_cache import CacheFormats, FP8PagedCaches
from glm5.vllm.names import MTP_ARCHITECTURE
from glm5.vllm.parallel import decode_tokens, groups
from glm5.weights import load as weights_module

#: the drafts vLLM would pick for a glm_moe_dsa checkpoint (SpeculativeConfig.hf_config_override)
VLLM_MTP_ARCHITECTURES = ("DeepseekV32MTPModel", "DeepSeekMTPModel")


def use_project_mtp(vllm_config: VllmConfig) -> None:
    """Point vLLM's MTP draft of a `Glm5BackendsForCausalLM` target at `Glm5BackendsMTP`."""
    from vllm.model_executor.models.registry import ModelRegistry

    spec = vllm_config.speculative_config
    if spec is None or spec.method != "mtp" or spec.draft_model_config is None:
        return
    draft = spec.draft_model_config
    if not set(draft.architectures) & set(VLLM_MTP_ARCHITECTURES):
        return
    draft.hf_config.architectures = [MTP_ARCHITECTURE]
    draft.model_arch_config.architectures = [MTP_ARCHITECTURE]
    draft._model_info, draft._architecture = ModelRegistry.inspect_model_cls([MTP_ARCHITECTURE], draft)


class Glm5BackendsMTP(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from glm5.vllm.model import default_backend

        mc = vllm_config.speculative_config.draft_model_config
        self.path = Path(mc.model)
        self.config = GLM5Config.from_dict(read_config(self.path))
        self.dtype = mc.dtype
        self.backend = backends.get(default_backend(current_platform.device_type))
        self.counts: Counter[str] = Counter()
        c, cc = self.config, vllm_config.cache_config
        if c.num_nextn_predict_layers < 1:
            raise ValueError(
                "speculative_config: method 'mtp' needs an MTP layer, the checkpoint has "
                "num_nextn_predict_layers 0"
            )
        self.groups = groups(vllm_config.parallel_config, decode_tokens(vllm_config))  # the target's plan
        self.tp, self.ep = self.groups.tp, self.groups.ep
        if self.tp is not None:
            check_plan(c, self.tp.size, 1 if self.ep is None else self.ep.size)
        #: vLLM's iterator, each rank its slice (quantized: the MTP layers' modules from the quantization
        #: config, quant.load.skeleton, and only their tensors loaded: glm5/weights/quantized.py)
        self.quantized = is_quantized(self.path)
        if self.quantized:
            from quant.load import skeleton

            glm = _mtp_only(skeleton(self.path, backend=self.backend, dtype=self.dtype))
            self.names = weights_module.split_skeleton(glm, self.groups)  # MTP layers
            self._set_model(glm)
        else:
            with torch.device("meta"):
                glm = GLM5ForCausalLM(c, backend=self.backend, dtype=self.dtype)
            self.names = weights_module.CheckpointNames(glm)  # before the split: full shapes
            self._set_model(self._split(glm))
            self.glm.to_empty(device=torch.get_default_device())  # local slices only
            self.glm.requires_grad_(False).eval()
        fmt = CacheFormats(c, cc.cache_dtype, self.backend, self.dtype)
        n = c.num_hidden_layers
        latent, index_k = [], []
        for j in range(c.num_nextn_predict_layers):  # vLLM's names for MTP layers: model.layers.{n + j}
            pre = f"{prefix}model.layers.{n + j}.self_attn"
            latent.append(Glm5CacheLayer(f"{pre}.latent_cache", *fmt.latent, cc, False))
            index_k.append(Glm5CacheLayer(f"{pre}.indexer.k_cache", *fmt.index, cc, True))
        self.latent_caches, self.index_caches = nn.ModuleList(latent), nn.ModuleList(index_k)
        # FP8 caches are written quantized; their kind picks the backend's FP8 kernels (fp8_cache.py)
        self.caches = FP8PagedCaches(latent, index_k, self.backend)
        self.cache_names = [m.prefix for m in latent + index_k]

    def _split(self, glm: GLM5ForCausalLM) -> GLM5ForCausalLM:
        """The plan applied to the whole model (so parameter names and slices are the target's), then
        everything but the MTP layers dropped."""
        if self.tp is not None:
            apply(glm, tp=self.tp, ep=self.ep, **self.groups.plan_args())
        return _mtp_only(glm)

    def _set_model(self, glm: GLM5ForCausalLM) -> None:
        self.glm = glm
        self.model = glm.model  # vLLM gives the draft the target's embedding through draft.model.embed_tokens
        self.mtp_layers = [
            glm.model.layers[i] for i in range(glm.config.num_hidden_layers, len(glm.model.layers))
        ]

    def _head(self) -> nn.Module:
        head = self._modules.get("lm_head")
        if head is None:  # vLLM shares the target's head with an MTP draft when the target has `lm_head`
            raise RuntimeError("Glm5BackendsMTP: vLLM did not give the MTP draft the target's lm_head")
        return head

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
        **_: object,
    ) -> torch.Tensor:
        """Tokens one ahead of the target's hidden states (or of this layer's previous output) -> the MTP
        layer's output before its head norm (compute_logits applies it; the next draft reads it as is)."""
        meta = get_forward_context().attn_metadata
        md = meta.get(self.cache_names[0]) if isinstance(meta, dict) else None
        t = input_ids.shape[0]
        if md is None:  # vLLM's profiling / dummy run: no cache
            step = self.glm.begin_step([t], None)
            n = t
        else:
            if any(meta.get(p) is not md for p in self.cache_names):
                raise RuntimeError("vLLM gave the MTP layer's caches different metadata in one step")
            n = md.num_tokens
            pos = positions[:n].to(torch.int64)
            cos, sin = rope_angles(pos, self.config.qk_rope_head_dim, self.config.rope_theta)
            step = Step(self.backend, StepSlots(md.layout, pos, md.slot_mapping), cos, sin, self.caches)
            self.counts["draft_steps"] += 1
        layer = self.mtp_layers[spec_step_idx % len(self.mtp_layers)]
        emb = self.model.embed_tokens(input_ids[:n])
        # the embedding at position 0 is zeroed (glm5.core.model.GLM5ForCausalLM.mtp_forward, vLLM's MTP
        # layer)
        emb = emb.masked_fill((step.slots.positions == 0)[:, None], 0.0)
        x = layer.predict(emb, hidden_states[:n], step)
        if n == t:
            return x
        out = x.new_zeros(t, x.shape[1])
        out[:n] = x
        return out

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        layer = self.mtp_layers[spec_step_idx % len(self.mtp_layers)]
        return self._head()(layer.shared_head.norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Float checkpoints: the MTP layers' tensors of vLLM's iterator, each rank copying its slice (the
        rest is the target's) -> the names loaded; quantized ones the same way (names of the MTP layers)."""
        if self.quantized:
            mine = ((hf, t) for hf, t in weights if hf in self.names.params or hf in self.names.quant)
            return {f"glm.{name}" for name in weights_module.load(self.glm, self.names, mine)}
        return {f"glm.{name}" for name in weights_module.load(self.glm, self.names, self._own(weights))}

    def _own(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's pairs without the target's tensors (main layers, embedding, final norm, head)."""
        held = set(self.glm.state_dict(keep_vars=True))
        for hf, t in weights:
            entry = self.names.params.get(hf)
            if entry is None or entry[0] in held:
                yield hf, t

    def process_weights_after_loading(self) -> None:
        """vLLM's post-load hook (every load format): weights laid out once for the backend."""
        self.glm.prepare_weights()


def _mtp_only(glm: GLM5ForCausalLM) -> GLM5ForCausalLM:
    """`glm` holding only its MTP layers (at their own indices, so names and the plan's slices are the
    whole model's): the main layers become empty placeholders; the embedding, the final norm and the head
    are dropped (the target's are used)."""
    for i in range(glm.config.num_hidden_layers):
        glm.model.layers[i] = nn.Identity()
    del glm.model.embed_tokens, glm.model.norm, glm.lm_head
    return glm
