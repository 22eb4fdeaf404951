"""vLLM config hook for `Glm5BackendsForCausalLM` (vLLM's MODELS_CONFIG_MAP, keyed by architecture, so
it touches no other model, `GlmMoeDsaForCausalLM` included)."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from backends import BackendUnavailable
from backends.cache_layout import MLACacheLayout
from backends.registry import loaded
from glm5.core.checkpoint import read_config
from glm5.core.config import GLM5Config
from glm5.parallel import invariant
from glm5.parallel.plan import PlanError
from glm5.parallel.plan import check as check_plan
from glm5.vllm.fp8_cache import FLOAT_CACHE_DTYPES, check_cache_dtype
from glm5.vllm.mtp import use_project_mtp


class Glm5BackendsConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        # The checkpoint's model_type (glm_moe_dsa) marks it a DeepSeek-MLA model, which makes vLLM plan
        # for its own MLA attention: on CPU that forces block_size 16 and turns chunked prefill and
        # prefix caching off. This architecture brings its own cache layers and attention (the GLM-5
        # backend's), so vLLM's MLA paths do not apply.
        model_config.model_arch_config.is_deepseek_mla = False

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        # 'auto' (the model dtype) or fp8_ds_mla (glm5/vllm/fp8_cache.py), checked before anything loads
        check_cache_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config.hf_config)
        use_backend_block_size(vllm_config)
        use_project_mtp(vllm_config)  # speculative method 'mtp': the project's MTP layer drafts
        check_parallel_layout(vllm_config)


def check_parallel_layout(vllm_config) -> None:
    """Refuse, from the config alone and before any rank starts, a layout the plan cannot split (a count the
    ranks do not divide, e.g. experts over the expert group's data x tensor-parallel ranks) or the
    layout-invariant mode with experts split on their intermediate dim: a ValueError naming the argument."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    if invariant.from_env_requested() and pc.tensor_parallel_size > 1 and not pc.enable_expert_parallel:
        raise ValueError(
            f"enable_expert_parallel: {invariant.ENV}=1 at tensor_parallel_size {pc.tensor_parallel_size} "
            "needs expert parallel (without it the experts are split on their intermediate dim, which has "
            "no exact split product in the layout-invariant mode); pass enable_expert_parallel"
        )
    path = Path(mc.model)
    if not (path / "config.json").is_file():
        return  # the model refuses it when built, naming `model`
    tp = pc.tensor_parallel_size
    ep = tp * pc.data_parallel_size if pc.enable_expert_parallel else 1
    try:
        check_plan(GLM5Config.from_dict(read_config(path)), tp, ep)
    except PlanError as e:
        arg = "enable_expert_parallel" if ep > 1 else "tensor_parallel_size"
        raise ValueError(f"{arg}: tensor_parallel_size {tp}, expert group of {ep} ranks: {e}") from None


def _backend_cache_layout() -> tuple[str, MLACacheLayout] | None:
    """(name, declared MLA cache layout) of the backend the model will run on; None when none resolves
    (the model then raises the reason when it is built)."""
    from glm5.vllm.model import default_backend

    try:
        name = default_backend(current_platform.device_type)
    except BackendUnavailable:
        return None
    backend = loaded(name)
    return None if backend is None else (name, backend.mla_cache)


def use_backend_block_size(vllm_config) -> None:
    """Set vLLM's block size to the one the backend's split latent pools need (backends/cache_layout.py,
    e.g. Ascend's 128 for npu_sparse_flash_attention's PA_BSND pools), so vLLM allocates what the backend
    reads with no copy. A user's different `--block-size` is refused in one line naming `block_size`."""
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    found = _backend_cache_layout()
    if found is None or cc.cache_dtype not in FLOAT_CACHE_DTYPES:
        return  # FP8 caches keep their 656-byte rows, one tensor
    name, layout = found
    dtype = mc.dtype if cc.cache_dtype == "auto" else getattr(torch, cc.cache_dtype)
    width = mc.hf_config.kv_lora_rank + mc.hf_config.qk_rope_head_dim
    need = layout.required_block_size(width, dtype)
    if need is None or cc.block_size == need:
        return
    if cc.user_specified_block_size:
        raise ValueError(
            f"block_size: backend {name!r} stores the latent cache as split pools {list(layout.split)} "
            f"that need block size {need}, got {cc.block_size} (leave --block-size unset or pass {need})"
        )
    cc.block_size = need
