"""GLM-5-FP8-style checkpoints (quant/formats/fp8.py): export, load with FP8 modules, bitwise round trip,
the float loader's block-by-block de-quantization, and conversion to the Ascend W8A8 recipe."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from glm5.loader import load_model
from quant import quantize_model
from quant.formats import fp8
from quant.fp8_modules import FP8Experts, FP8Linear
from quant.load import detect_format, export, load_quantized
from tests.quant.conftest import ids, tiny_model


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits.float().flatten()


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _tensors(path):
    with safe_open(path / "model.safetensors", "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "glm5-fp8"
    fp8.export(tiny_model(), path)
    return path


def test_layout_is_the_published_one(fp8_dir):
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    t = _tensors(fp8_dir)
    w, s = (
        t["model.layers.1.mlp.experts.3.down_proj.weight"],
        t["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"],
    )
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)
    assert t["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    for kept in (
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert t[kept].dtype != torch.float8_e4m3fn and kept + "_scale_inv" not in t
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in t
    assert detect_format(fp8_dir) == "fp8"


def test_loads_fp8_modules_and_round_trips_bitwise(fp8_dir, tmp_path):
    model = load_model(fp8_dir, backend="reference")
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert isinstance(model.model.layers[1].mlp.experts, FP8Experts)
    assert not isinstance(model.model.layers[0].self_attn.kv_b_proj, FP8Linear)  # de-quantized at load
    export(model, tmp_path / "again", "fp8")
    a, b = _tensors(fp8_dir), _tensors(tmp_path / "again")
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a[k], b[k]))
        assert torch.equal(x, y), k
    again = load_quantized(tmp_path / "again", backend="reference")
    x = ids(1, 24)
    assert torch.equal(_logits(model, x), _logits(again, x))


def test_fp8_forward_tracks_its_dequantized_weights(fp8_dir):
    """FP8 linears (per-token 1x128 activation groups) against the same weights de-quantized in fp32."""
    x = ids(1, 24)
    fp8_model = fp8.load_fp8(fp8_dir, backend="reference", dtype=torch.float32)
    deq = fp8.load_fp8(fp8_dir, backend="reference", dtype=torch.float32, fp8_modules=False)
    assert _cos(_logits(fp8_model, x), _logits(deq, x)) > 0.98


def test_converts_to_w8a8_with_cosine_099(fp8_dir, tmp_path):
    x = ids(1, 24)
    source = fp8.load_fp8(fp8_dir, backend="reference", dtype=torch.bfloat16, fp8_modules=False)
    ref = _logits(source.float(), x)
    quantize_model(source, "glm5-w8a8")  # data-free, as `glm5 quantize --calib-seqs 0`
    export(source, tmp_path / "w8a8", "modelslim")
    w8a8 = load_quantized(tmp_path / "w8a8", backend="reference", dtype=torch.float32)
    assert _cos(_logits(w8a8, x), ref) >= 0.99


def test_rejects_other_fp8_layouts(tmp_path):
    with pytest.raises(ValueError, match="weight_block_size: expected \\[128, 128\\]"):
        fp8.check_config({"quant_method": "fp8", "weight_block_size": None})
    assert fp8.check_config({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})


def test_glm5_quantize_from_an_fp8_source(fp8_dir, tmp_path):
    from click.testing import CliRunner

    from glm5.cli import main

    out = tmp_path / "w8a8"
    args = [
        "quantize",
        "--model",
        str(fp8_dir),
        "--recipe",
        "glm5-w8a8",
        "--format",
        "modelslim",
        "--out",
        str(out),
        "--calib-seqs",
        "0",
        "--quiet",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    x = ids(1, 24)
    src = fp8.load_fp8(fp8_dir, backend="reference", dtype=torch.float32, fp8_modules=False)
    assert (
        _cos(_logits(load_quantized(out, backend="reference", dtype=torch.float32), x), _logits(src, x))
        >= 0.99
    )
    again = CliRunner().invoke(
        main, ["quantize", "--model", str(out), "--format", "fp8", "--out", str(tmp_path / "x"), "--quiet"]
    )
    assert again.exit_code == 2 and "already quantized (modelslim)" in again.output
