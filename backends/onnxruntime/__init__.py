"""The `onnxruntime` backend: every op of the contract as an ONNX function of the `glm5` domain
(functions/<op>.py, standard ONNX opset 18 operators only), run by ONNX Runtime's CPU execution
provider. The same functions are what a vendor toolchain that consumes ONNX compiles (docs/onnx.md).

Which file serves which op: backends/onnxruntime/<op>.py (capabilities, reasons, adapter ->
glm5.<op> in functions/<op>.py). `kernel_calls()` counts ONNX Runtime session runs per op.
"""

from __future__ import annotations

import platform
from collections import Counter

from backends.contract.table import load_ops
from backends.interface import Backend

_DEPS = ("onnx", "onnxscript", "onnxruntime")
try:  # the op modules import onnxscript at import time: a missing extra is reported by available()
    _OPS = load_ops("backends.onnxruntime")
except ModuleNotFoundError as exc:
    if exc.name not in _DEPS:
        raise
    _MISSING: str | None = exc.name
    _OPS: dict = {}
else:
    _MISSING = None


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    device = "cpu"
    ops = _OPS

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
