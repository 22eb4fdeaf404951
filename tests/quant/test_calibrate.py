"""Layer-by-layer calibration: smoothing leaves the float function unchanged, AWQ and GPTQ reduce the
quantization error they target, and a calibrated tiny model comes out fully quantized."""

from __future__ import annotations

import torch

from glm5.core.moe import Experts
from quant.apply import plan_model
from quant.calibrate import _smooth_layer, _Stats, awq_search
from quant.modules import QuantExperts, QuantLinear
from quant.quantize import quantize_model
from quant.quantizers import dequantize, quantize_weight
from quant.recipe import W4A8, Recipe, Scheme
from tests.quant.conftest import ids, tiny_model


def _layer_out(model, layer, x, step):
    with torch.no_grad():
        return layer(x, step, None)


def test_smoothing_preserves_the_float_layer():
    """SmoothQuant (norm-linear, ov, up-down) and AWQ (experts) only move scale between adjacent weights."""
    model = tiny_model(seed=2)
    recipe = Recipe.load("glm5-w4a8")
    plan = plan_model(model, recipe)
    x_ids = ids(2, 24, seed=3)
    step = model.begin_step([24, 24], None)
    x = model.model.embed_tokens(x_ids.reshape(-1)).detach()
    for i in (0, 1):  # dense layer, MoE layer
        layer = model.model.layers[i]
        before, topk = _layer_out(model, layer, x, step)
        norm_w = layer.input_layernorm.weight.detach().clone()
        st = _Stats(layer, f"model.layers.{i}", set())
        _layer_out(model, layer, x, step)
        st.close()
        _smooth_layer(layer, f"model.layers.{i}", plan, recipe, st)
        assert not torch.equal(norm_w, layer.input_layernorm.weight)  # smoothing did something
        after, topk2 = _layer_out(model, layer, x, step)
        assert torch.equal(topk, topk2)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
        x = after


def test_awq_search_beats_identity_on_outlier_channels():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(256, 64, generator=g)
    a[:, :4] *= 40  # a few outlier input channels
    w = torch.randn(32, 64, generator=g)
    recipe = Recipe.load("glm5-w4a8")
    s = awq_search(a, w, Scheme(W4A8), recipe, 20)

    def err(scale):
        q, sc = quantize_weight(w * scale[None, :], 4, None, "qmax", "ssz")
        return float(((a / scale) @ dequantize(q, sc).T - a @ w.T).pow(2).mean())

    assert err(s) < 0.7 * err(torch.ones(64))


def test_calibrated_model_is_fully_quantized_and_close():
    calib = ids(2, 24, seed=6)
    for name, gs in (("glm5-w4a8", None), ("glm5-w4a8-g128", 16)):  # AWQ + SSZ; AWQ + GPTQ per group
        model = tiny_model(seed=3)
        ref = model(ids(1, 24, seed=7)).logits.detach()
        plan = quantize_model(model, Recipe.load(name, group_size=gs), calib)
        for n in plan:
            mod = n.split(".mlp.experts.")[0] + ".mlp.experts" if ".experts." in n else n
            owner = model.get_submodule(mod)
            assert isinstance(owner, (QuantLinear, QuantExperts)), n
        assert not isinstance(model.model.layers[1].mlp.experts, Experts)
        with torch.no_grad():
            out = model(ids(1, 24, seed=7)).logits
        rel = float((out - ref).norm() / ref.norm())
        assert 0 < rel < 0.2, (name, rel)
