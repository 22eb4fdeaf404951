"""The `onnxruntime` backend: every op of the contract as an ONNX function of the `glm5` domain
(functions/<op>.py, standard ONNX opset 18 operators only), run by ONNX Runtime's CPU execution
provider. The same functions are what a vendor toolchain that consumes ONNX compiles (docs/onnx.md).

Which file serves which op: backends/onnxruntime/<op>.py (capabilities, reasons, adapter ->
glm5.<op> in functions/<op>.py). `kernel_calls()` counts ONNX Runtime session runs per op.
"""

from __future__ import annotations

import platform
from collections import Counter

from backends.interface import Backend

_DEPS = ("onnx", "onnxscript", "onnxruntime")
try:
    from backends.onnxruntime import (
        dynamic_quant_int8,
        grouped_matmul,
        indexer_logits,
        indexer_topk,
        linear_cross_entropy,
        sparse_mla_attention,
        topk,
        w4a8_matmul,
        w8a8_matmul,
    )
except ModuleNotFoundError as exc:  # only a missing optional dependency is reported by available()
    if exc.name not in _DEPS:
        raise
    _MISSING: str | None = exc.name
    _MODULES: dict = {}
else:
    _MISSING = None
    _MODULES = {
        "indexer_logits": indexer_logits,
        "indexer_topk": indexer_topk,
        "topk": topk,
        "sparse_mla_attention": sparse_mla_attention,
        "dynamic_quant_int8": dynamic_quant_int8,
        "w8a8_matmul": w8a8_matmul,
        "w4a8_matmul": w4a8_matmul,
        "grouped_matmul": grouped_matmul,
        "linear_cross_entropy": linear_cross_entropy,
    }


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    device = "cpu"
    ops = {op: mod.IMPL for op, mod in _MODULES.items()}

    def available(self) -> tuple[bool, str]:
        if _MISSING is not None:
            return False, f"{_MISSING} is not installed; pip install 'glm5-backends[onnx]'"
        import onnxruntime

        if "CPUExecutionProvider" not in onnxruntime.get_available_providers():
            return False, f"onnxruntime {onnxruntime.__version__} has no CPUExecutionProvider"
        return True, f"ONNX Runtime {onnxruntime.__version__} CPUExecutionProvider"

    def kernel_calls(self) -> Counter[str]:
        from backends.onnxruntime._session import RUNS

        return Counter(RUNS)

    def environment(self) -> dict[str, str]:
        if _MISSING is not None:
            return {**super().environment(), "missing": _MISSING}
        import onnx
        import onnxruntime
        import onnxscript

        from backends.onnxruntime.functions import OPSET

        env = super().environment()
        env.update(
            onnx=onnx.__version__,
            onnxruntime=onnxruntime.__version__,
            onnxscript=onnxscript.__version__,
            opset=str(OPSET),
            python=platform.python_version(),
        )
        return env
