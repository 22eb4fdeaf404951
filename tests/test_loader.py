"""The application layer's loader (glm5/loader.py) reads float and quantized checkpoints; the model core's
`from_pretrained` reads float ones only and refuses a quantized export in one line naming the loader."""

from __future__ import annotations

import json

import pytest
import torch

from glm5.core.checkpoint import NotACheckpoint
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.loader import load_model
from quant.load import export
from quant.quantize import quantize_model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(0)
    return model.eval()


def _logits(model):
    ids = torch.arange(1, 9).view(1, 8) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


def test_the_loader_reads_a_float_checkpoint(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "f")
    back = load_model(tmp_path / "f", backend="reference")
    assert type(back) is GLM5ForCausalLM
    assert torch.equal(_logits(back), _logits(tiny))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelslim"])
def test_from_pretrained_refuses_a_quantized_export_naming_the_loader(tiny, tmp_path, fmt):
    q = GLM5ForCausalLM(tiny.config, backend="reference")
    q.load_state_dict(tiny.state_dict())
    quantize_model(q, "glm5-w8a8")
    export(q, tmp_path / "q", fmt)
    with pytest.raises(NotACheckpoint) as info:
        GLM5ForCausalLM.from_pretrained(tmp_path / "q", backend="reference")
    msg = str(info.value)
    assert "\n" not in msg and "glm5.loader.load_model" in msg
    assert torch.equal(_logits(load_model(tmp_path / "q", backend="reference")), _logits(q))


def test_a_quantization_config_alone_is_refused(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "f")
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    (tmp_path / "f" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"x": 1}}))
    refusal = r"has quantization_config\); load it with glm5\.loader\.load_model"
    with pytest.raises(NotACheckpoint, match=refusal):
        GLM5ForCausalLM.from_pretrained(tmp_path / "f", backend="reference")
