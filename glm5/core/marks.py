"""What marks a directory as a quantized export, so the float reader (`from_pretrained`) can refuse it in one
line. Which format it is, is `quant.load.detect_format`'s to say (glm5/loader.py reads both kinds)."""

from __future__ import annotations

import json
from pathlib import Path

from glm5.infra import fsio

#: msModelSlim's description file: it marks a quantized export as config.json's quantization_config does
MODELSLIM_DESCRIPTION = "quant_model_description.json"


def quantized_mark(path: str | Path) -> str | None:
    """What marks `path` as a quantized export (which the float reader refuses), else None. Only files
    inside `path` are read; which format it is, is quant.load.detect_format's to say."""
    path = Path(path)
    if (path / MODELSLIM_DESCRIPTION).exists():
        return MODELSLIM_DESCRIPTION
    try:
        cfg = json.loads(fsio.inside(path, "config.json", "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (
        "config.json has quantization_config"
        if isinstance(cfg, dict) and "quantization_config" in cfg
        else None
    )
