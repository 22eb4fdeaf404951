"""The `cuda` backend: Triton kernels (kernels_cuda/) on NVIDIA GPUs, or on CPU tensors in Triton's
interpreter when TRITON_INTERPRET=1 (set before import; CI uses it to prove kernel logic).

Which file serves which op: backends/cuda/<op>.py (capabilities, reasons, adapter -> kernels_cuda.<op>).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter

import torch

from backends.contract.table import load_ops
from backends.interface import Backend


def _load_ops() -> dict:
    """op -> OpImpl from backends/cuda/<op>.py. Without triton the table is empty (the adapters import
    their kernels), so the backend still loads and `available()` says why it cannot run."""
    if importlib.util.find_spec("triton") is None:
        return {}
    return load_ops("backends.cuda")


class CudaBackend(Backend):
    name = "cuda"
    # ops without an implementation are absent, so calling them raises NotSupported with that reason
    ops = _load_ops()

    def __init__(self) -> None:
        super().__init__()
        from kernels_cuda import interpreter_active

        self.interpreted = interpreter_active()
        self.device = "cpu" if self.interpreted else "cuda"

    def available(self) -> tuple[bool, str]:
        try:
            import triton
        except ImportError as exc:
            return False, f"triton is not installed ({exc}); pip install 'glm5-backends[cuda]'"
        if self.interpreted:
            return True, f"Triton {triton.__version__} interpreter on CPU tensors (TRITON_INTERPRET=1)"
        if not torch.cuda.is_available():
            return False, (
                "no CUDA device visible to torch; set TRITON_INTERPRET=1 before import to run the "
                "kernels on CPU tensors in Triton's interpreter"
            )
        return True, f"Triton {triton.__version__} on {torch.cuda.get_device_name()}"

    def kernel_calls(self) -> Counter[str]:
        from kernels_cuda import LAUNCHES

        return Counter(LAUNCHES)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env["interpreter"] = str(self.interpreted).lower()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = "missing"
        if not self.interpreted and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
        return env
