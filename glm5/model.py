"""Deprecated alias: `glm5.model` is `glm5.core.model`, the model (GLM5ForCausalLM and its layers).

The model core moved to glm5/core/ (f746332). This alias keeps imports of the old path working, with a
DeprecationWarning, for release 0.1.x and goes in the next release: import `glm5.core.model`, or the names
`glm5` exports (`glm5.GLM5Config`, `glm5.GLM5ForCausalLM`)."""

from __future__ import annotations

import warnings
from typing import Any

from glm5.core import model as _moved

warnings.warn(
    "glm5.model is deprecated and goes in the next release: import glm5.core.model",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


def __dir__() -> list[str]:
    return dir(_moved)
