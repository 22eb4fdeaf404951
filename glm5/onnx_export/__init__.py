"""Export of the GLM-5 model to ONNX with the `glm5` ONNX functions (docs/onnx.md).

Sits beside `glm5/` and `backends/` and depends on both; neither imports it.
"""
