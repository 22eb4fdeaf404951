"""Weight bytes per scheme and KV-cache bytes per token, against hand counts."""

from __future__ import annotations

from quant.apply import plan_model
from quant.memory import kv_bytes_per_token, preset_model, weight_bytes
from quant.recipe import Recipe


def test_tiny_weight_bytes_by_hand():
    model = preset_model("tiny")
    fp = weight_bytes(model, {})
    assert fp.total == sum(p.numel() * p.element_size() for p in model.parameters())
    q = weight_bytes(model, plan_model(model, Recipe.load("glm5-w4a8")))
    c = model.config
    # routed experts of the 3 main MoE layers: 8 x (2 x [32, 64] + [64, 32]) int4 + fp32 per-row scales
    experts = 3 * 8 * (2 * (32 * 64 // 2 + 32 * 4) + (64 * 32 // 2 + 64 * 4))
    assert q.by_scheme["W4A8_DYNAMIC"] == experts
    dense = 3 * (128 * 64 + 128 * 4)  # layer 0 gate/up/down: [128, 64] x2 and [64, 128], int8 + fp32 scale
    assert q.by_scheme["W8A8_DYNAMIC"] > dense
    assert q.mtp == fp.mtp  # the MTP layer stays bf16
    assert q.total < fp.total and c.num_hidden_layers == 4


def test_glm5_kv_bytes_per_token():
    c = preset_model("glm5-744b").config
    assert kv_bytes_per_token(c, "bf16", with_mtp=False) == 78 * (576 * 2 + 128 * 2)
    assert kv_bytes_per_token(c, "fp8", with_mtp=True) == 79 * (656 + 132)
