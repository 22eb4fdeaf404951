"""vLLM plugin: GLM-5 served by vLLM on any conformant GLM-5 backend (docs/vllm.md).

Installed with the `vllm` extra; vLLM runs `register` in every process through the
`vllm.general_plugins` entry point. It only adds an architecture, so it is opt-in per run:

    GLM5_BACKEND=reference vllm serve DIR --hf-overrides '{"architectures": ["Glm5BackendsForCausalLM"]}'

`GlmMoeDsaForCausalLM` keeps meaning vLLM's own implementation.
"""

from __future__ import annotations

from glm5.vllm.names import ARCHITECTURE, HF_OVERRIDES, MTP_ARCHITECTURE

__all__ = ["ARCHITECTURE", "HF_OVERRIDES", "MTP_ARCHITECTURE", "register"]


def register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from glm5.vllm.config import Glm5BackendsConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "glm5.vllm.model:Glm5BackendsForCausalLM")
    if MTP_ARCHITECTURE not in ModelRegistry.get_supported_archs():  # the MTP draft (glm5/vllm/mtp.py)
        ModelRegistry.register_model(MTP_ARCHITECTURE, "glm5.vllm.mtp:Glm5BackendsMTP")
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, Glm5BackendsConfig)
