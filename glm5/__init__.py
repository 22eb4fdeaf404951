"""GLM-5 on the backend layer: model, generation and training (they call `backends` ops only).

    import glm5
    model = glm5.GLM5ForCausalLM.from_pretrained("path/to/glm_moe_dsa", backend="reference")

Names are imported on first use, so `glm5 doctor` works even when the model cannot import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GLM5Config": "glm5.core.config",
    "GLM5ForCausalLM": "glm5.core.model",
    "GLM5Output": "glm5.core.model",
    "KVCache": "glm5.core.cache",
    "CheckpointError": "glm5.core.checkpoint",
    "generate": "glm5.generate",
    "generate_speculative": "glm5.generate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm5' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
