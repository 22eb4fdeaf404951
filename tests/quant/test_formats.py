"""compressed-tensors and msModelSlim exports reload into the model with outputs identical to the
in-memory quantized model; stored tensors have the layouts vLLM / vllm-ascend expect; bad files refuse."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quant.apply import tensor_schemes
from quant.load import detect_format, export, load_quantized
from quant.quantize import quantize_model
from quant.recipe import FLOAT, Recipe
from tests.quant.conftest import ids, tiny_model

E1 = "model.layers.1.mlp.experts.3"


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(ids(2, 24, seed=5)).logits


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelslim"])
def test_export_reload_identical(w4a8_model, tmp_path, fmt):
    export(w4a8_model, tmp_path / "q", fmt)
    assert detect_format(tmp_path / "q") == fmt
    back = load_quantized(tmp_path / "q", backend="reference")
    assert torch.equal(_logits(back), _logits(w4a8_model))
    a, b = w4a8_model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_compressed_tensors_layout(w4a8_model, tmp_path):
    export(w4a8_model, tmp_path / "q", "compressed-tensors")
    t = load_file(tmp_path / "q" / "model.safetensors")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    fmts = {g["format"]: g for g in qc["config_groups"].values()}
    assert fmts["pack-quantized"]["weights"]["num_bits"] == 4
    assert fmts["int-quantized"]["weights"]["num_bits"] == 8
    assert all(
        g["input_activations"]["strategy"] == "token" and g["input_activations"]["dynamic"]
        for g in fmts.values()
    )
    assert "model.layers.4.self_attn.q_a_proj" in qc["ignore"]  # MTP attention: same regex, float
    assert t[f"{E1}.down_proj.weight_packed"].dtype == torch.int32
    assert t[f"{E1}.down_proj.weight_packed"].shape == (64, 32 // 8)
    assert t[f"{E1}.down_proj.weight_shape"].tolist() == [64, 32]
    assert t[f"{E1}.down_proj.weight_scale"].shape == (64, 1)
    assert t["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.int8
    assert t["model.layers.1.self_attn.q_a_proj.weight_scale"].shape == (48, 1)
    assert t["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32
    assert t["model.layers.4.mlp.experts.0.gate_proj.weight"].dtype == torch.float32  # MTP experts float


def test_modelslim_layout_and_description(w4a8_model, tmp_path):
    export(w4a8_model, tmp_path / "q", "modelslim")
    t = load_file(tmp_path / "q" / "model.safetensors")
    desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
    assert desc["version"] == "1.0.0"
    assert desc["model_quant_type"] == "W4A8_DYNAMIC"
    assert desc["group_size"] == 0
    assert set(t) <= set(desc) and all(desc[k] in ("W8A8_DYNAMIC", "W4A8_DYNAMIC", FLOAT) for k in t)
    assert desc[f"{E1}.gate_proj.weight"] == "W4A8_DYNAMIC"
    assert desc[f"{E1}.gate_proj.scale_bias"] == "W4A8_DYNAMIC"
    assert desc["model.layers.1.mlp.gate.weight"] == FLOAT
    assert desc["model.layers.0.mlp.up_proj.weight"] == "W8A8_DYNAMIC"
    assert t[f"{E1}.gate_proj.weight"].dtype == torch.int8 and t[f"{E1}.gate_proj.weight"].shape == (16, 64)
    assert t[f"{E1}.gate_proj.scale_bias"].shape == (32, 1)
    assert t[f"{E1}.down_proj.scale_bias"].shape == (64, 16)
    assert not t[f"{E1}.up_proj.weight_offset"].any() and t[f"{E1}.up_proj.weight_scale"].shape == (32, 1)
    assert t["model.layers.0.mlp.up_proj.weight"].shape == (128, 64)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert "quantization_config" not in cfg
    # every tensor of the float model is described, with the scheme the recipe gave it
    plan_desc = tensor_schemes(tiny_model(), {})
    assert set(plan_desc) <= set(desc)


def test_modelslim_refuses_wrong_nibble_order(w4a8_model, tmp_path):
    export(w4a8_model, tmp_path / "q", "modelslim")
    f = tmp_path / "q" / "model.safetensors"
    with safe_open(f, "pt") as h:
        meta = h.metadata()
    t = load_file(f)
    w = t[f"{E1}.up_proj.weight"].view(torch.uint8)
    t[f"{E1}.up_proj.weight"] = ((w >> 4) | (w << 4)).view(torch.int8)  # swap the two rows of each byte
    save_file(t, f, metadata=meta)
    with pytest.raises(ValueError, match="scale_bias"):
        load_quantized(tmp_path / "q")


def test_reload_refuses_extra_and_missing_tensors(w4a8_model, tmp_path):
    export(w4a8_model, tmp_path / "q", "compressed-tensors")
    f = tmp_path / "q" / "model.safetensors"
    t = load_file(f)
    save_file({**t, "model.layers.0.extra": torch.zeros(1)}, f)
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_quantized(tmp_path / "q")
    t.pop(f"{E1}.up_proj.weight_scale")
    save_file(t, f)
    with pytest.raises(KeyError, match="weight_scale"):
        load_quantized(tmp_path / "q")


def test_per_group_compressed_tensors_round_trip_and_modelslim_refusal(tmp_path):
    model = tiny_model(seed=1, dtype=torch.bfloat16)
    quantize_model(model, Recipe.load("glm5-w4a8", group_size=16))
    export(model, tmp_path / "g", "compressed-tensors")
    back = load_quantized(tmp_path / "g")
    assert back.dtype == torch.bfloat16
    assert back.model.layers[1].mlp.experts.w13_scale.shape == (8, 64, 64 // 16)
    assert torch.equal(_logits(back), _logits(model))
    with pytest.raises(ValueError, match="per channel only"):
        export(model, tmp_path / "m", "modelslim")


def test_the_loader_loads_quantized(w4a8_model, tmp_path):
    from glm5.loader import load_model

    export(w4a8_model, tmp_path / "q", "modelslim")
    back = load_model(tmp_path / "q", backend="reference")
    assert torch.equal(_logits(back), _logits(w4a8_model))
