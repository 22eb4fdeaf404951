"""Deprecated alias: `glm5.config` is `glm5.core.config`, the model's configuration (GLM5Config, the presets).

The model core moved to glm5/core/ (f746332). This alias keeps imports of the old path working, with a
DeprecationWarning, for release 0.1.x and goes in the next release: import `glm5.core.config`, or the names
`glm5` exports (`glm5.GLM5Config`, `glm5.GLM5ForCausalLM`)."""

from __future__ import annotations

import warnings
from typing import Any

from glm5.core import config as _moved

warnings.warn(
    "glm5.config is deprecated and goes in the next release: import glm5.core.config",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


def __dir__() -> list[str]:
    return dir(_moved)
