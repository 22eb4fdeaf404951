"""Shared fixtures: the tiny GLM-5 preset with random weights (fp32, reference backend), and short
inputs with more keys (24) than the tiny preset's index_topk (16), so DSA is really sparse."""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from quant.quantize import quantize_model


def tiny_model(seed: int = 0, dtype: torch.dtype | None = None) -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference", dtype=dtype)
    model.init_weights(seed)
    return model.eval()


def ids(b: int = 1, s: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def w4a8_model() -> GLM5ForCausalLM:
    m = tiny_model()
    quantize_model(m, "glm5-w4a8")
    return m
