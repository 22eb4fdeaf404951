"""vLLM config hook for `Glm5BackendsForCausalLM` (vLLM's MODELS_CONFIG_MAP, keyed by architecture, so
it touches no other model, `GlmMoeDsaForCausalLM` included)."""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from glm5.vllm.fp8_cache import check_cache_dtype
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
        use_project_mtp(vllm_config)  # speculative method 'mtp': the project's MTP layer drafts
