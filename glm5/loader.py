"""Load any GLM-5 checkpoint: the application layer's one reader.

A quantized export (compressed-tensors, msModelSlim, GLM-5-FP8: `quant.load.detect_format`, the one
detection) goes to `quant.load.load_quantized`; a float Hugging Face directory to
`GLM5ForCausalLM.from_pretrained`. The model core reads float checkpoints only and never imports `quant`
(README "Layers").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from backends import Backend
from glm5.core.model import GLM5ForCausalLM
from quant.load import is_quantized, load_quantized

__all__ = ["is_quantized", "load_model"]


def load_model(
    path: str | Path,
    backend: Backend | str | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> nn.Module:
    """The model `path` holds, quantized or float, on `backend` (strict: every tensor accounted for)."""
    if is_quantized(path):
        return load_quantized(path, backend=backend, dtype=dtype)
    return GLM5ForCausalLM.from_pretrained(path, backend=backend, dtype=dtype, strict=strict)
