"""Recipe coverage on the tiny model: every weight gets exactly one scheme; the kept-bf16 list holds."""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from quant.apply import hf_tensor_names, plan_model, tensor_schemes
from quant.recipe import FLOAT, W4A8, W8A8, Recipe, available
from tests.quant.conftest import tiny_model

KEPT = ("mlp.gate.weight", "self_attn.kv_b_proj.weight", "indexer.wk.weight", "indexer.weights_proj.weight")


def test_recipes_ship():
    assert {"glm5-w4a8", "glm5-w8a8", "glm5-w4a8-g128"} <= set(available())


@pytest.mark.parametrize("name", ["glm5-w4a8", "glm5-w8a8", "glm5-w4a8-g128"])
def test_every_tiny_tensor_has_one_scheme_and_kept_list_holds(name):
    model = tiny_model()
    recipe = Recipe.load(name, group_size=16 if name.endswith("g128") else None)
    ts = tensor_schemes(model, plan_model(model, recipe))
    names = [t for t, _ in hf_tensor_names(model)]
    assert len(ts) == len(names) == len(set(names))  # one entry per stored tensor
    assert set(model.state_dict()) <= {
        n.split(".mlp.experts.")[0] + ".mlp.experts." + n.split(".")[-2] if ".mlp.experts." in n else n
        for n in names
    }
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    for t, s in ts.items():
        if (
            t.endswith(KEPT)
            or t.startswith(mtp)
            or t in ("model.embed_tokens.weight", "lm_head.weight")
            or not t.endswith(".weight")
            or "norm" in t
        ):
            assert s == FLOAT, t
        elif ".mlp.experts." in t:
            assert s == (W4A8 if "w4a8" in name else W8A8), t
        else:
            assert s == W8A8, t  # attention, dense and shared MLPs
    assert any(s == W8A8 for s in ts.values())


def test_ambiguous_and_kept_violations_raise():
    model = tiny_model()
    both = Recipe.from_dict(
        {
            "name": "x",
            "rules": [
                {"scheme": W8A8, "targets": ["*q_a_proj"]},
                {"scheme": W8A8, "targets": ["*self_attn*"]},
            ],
        }
    )
    with pytest.raises(ValueError, match="matches rules"):
        plan_model(model, both)
    kept = Recipe.from_dict(
        {"name": "x", "keep_float": ["*kv_b_proj"], "rules": [{"scheme": W8A8, "targets": ["*self_attn*"]}]}
    )
    with pytest.raises(ValueError, match="keep_float"):
        plan_model(model, kept)
    split = Recipe.from_dict({"name": "x", "rules": [{"scheme": W4A8, "targets": ["*experts.0.*"]}]})
    with pytest.raises(ValueError, match="stacked experts"):
        plan_model(model, split)
    with pytest.raises(ValueError, match="recipe"):
        Recipe.load("no-such-recipe")
    with pytest.raises(ValueError, match=r"rules\[0\].scheme"):
        Recipe.from_dict({"rules": [{"scheme": "W2", "targets": ["*"]}]})


def test_glm5_744b_plan_matches_the_published_recipe():
    """The full preset on the meta device: layer 78 (MTP) float, 3 dense + 75 MoE layers quantized."""
    with torch.device("meta"):
        model = GLM5ForCausalLM(
            GLM5Config.from_preset("glm5-744b"), backend="reference", dtype=torch.bfloat16
        )
    plan = plan_model(model, Recipe.load("glm5-w4a8"))
    experts = [n for n, s in plan.items() if s.name == W4A8]
    assert len(experts) == 75 * 256 * 3
    assert not any(n.startswith("model.layers.78.") for n in plan)
    assert plan["model.layers.0.mlp.down_proj"].name == W8A8
    assert plan["model.layers.77.mlp.shared_experts.up_proj"].name == W8A8
    assert "model.layers.5.self_attn.kv_b_proj" not in plan and "model.layers.5.mlp.gate" not in plan


@pytest.mark.parametrize(
    "text, field",
    [
        ("rules: 5\n", "rules: expected a list"),
        ("rules: [5, 6]\n", "rules[0]: expected a mapping"),
        ("rules: [{name: a, scheme: W8A8_DYNAMIC, targets: 5}]\n", "rules[0].targets: expected a list"),
        ("rules: [{name: a, scheme: W8A8_DYNAMIC, targets: [3]}]\n", "rules[0].targets[0]: expected a"),
        ("rules: [{scheme: W4A8_DYNAMIC, targets: ['*'], group_size: x}]\n", "rules[0].group_size"),
        ("keep_float: 3\nrules: []\n", "keep_float: expected a list"),
        ("calibration: 3\n", "calibration: expected a mapping"),
        ("- 1\n", "expected a YAML mapping"),
        ("rules: [\n", "not a readable YAML file"),
    ],
)
def test_a_recipe_file_of_the_wrong_shape_is_one_error_naming_the_field(tmp_path, text, field):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Recipe.load(tmp_path / "r.yaml")
