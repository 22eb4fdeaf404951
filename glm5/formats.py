"""Checkpoint formats other than the float Hugging Face layout, as plugins (like backends).

The model core never imports `quant`: quantization is applied from outside the model. A package that
reads other formats (this project's `quant`: compressed-tensors, msModelSlim, FP8) declares an entry
point in the group `glm5.checkpoint_formats` naming an object with

    name: str
    detect(path: Path) -> bool
    load(path, backend=..., dtype=..., cls=...) -> model

and `GLM5ForCausalLM.from_pretrained` hands it the directories it claims.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from glm5.core import fsio

ENTRY_POINT_GROUP = "glm5.checkpoint_formats"


@cache
def installed() -> tuple[Any, ...]:
    """Every installed checkpoint-format plugin (loaded once)."""
    return tuple(ep.load() for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))


def claiming(path: str | Path) -> Any | None:
    """The plugin that reads `path`, else None (a float checkpoint, or one no plugin knows)."""
    p = Path(path)
    for fmt in installed():
        if fmt.detect(p):
            return fmt
    return None


def looks_quantized(path: str | Path) -> bool:
    """config.json declares a quantization_config (what every quantized Hugging Face export carries)."""
    try:  # only a config.json inside `path` (a symlink out of it is not read)
        cfg = fsio.inside(Path(path), "config.json", "config.json")
        return "quantization_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
