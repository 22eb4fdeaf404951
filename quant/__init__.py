"""Quantization of GLM-5 from outside the model: recipes (quant/recipes/*.yaml), weight quantizers,
layer-by-layer calibration, quantized modules on the backend ops (SPEC 2.5-2.8), and the
compressed-tensors / msModelSlim checkpoint formats. See docs/quantization.md."""

from quant.apply import plan_model
from quant.load import detect_format, export, is_quantized, load_quantized
from quant.quantize import quantize_model
from quant.recipe import Recipe

__all__ = [
    "Recipe",
    "plan_model",
    "quantize_model",
    "export",
    "load_quantized",
    "is_quantized",
    "detect_format",
]
