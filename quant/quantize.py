"""`quantize_model`: a recipe applied to a model in place, with or without calibration data
(quant/apply.py plans and swaps modules; quant/calibrate.py runs the layer-by-layer calibration)."""

from __future__ import annotations

import torch
from torch import nn

from quant.apply import plan_model, quantize_modules
from quant.calibrate import calibrate
from quant.recipe import Recipe, Scheme


def quantize_model(
    model: nn.Module, recipe: Recipe | str, calib_ids: torch.Tensor | None = None, **calib_kw
) -> dict[str, Scheme]:
    """Quantize `model` in place by `recipe`. calib_ids [B, S] int: layer-by-layer calibration (smoothing,
    AWQ, GPTQ; quant/calibrate.py); None: data-free round-to-nearest (minmax or SSZ). Returns the plan."""
    recipe = Recipe.load(recipe) if isinstance(recipe, str) else recipe
    plan = plan_model(model, recipe)
    if calib_ids is not None:
        calibrate(model, recipe, plan, calib_ids, **calib_kw)
    quantize_modules(model, plan, recipe)  # whatever calibration left (MTP, head) is data-free
    if hasattr(model, "prepare_weights"):
        model.prepare_weights()  # the backend lays the quantized weights out once
    model.quant_plan = plan
    model.quant_recipe = recipe.name
    return plan
