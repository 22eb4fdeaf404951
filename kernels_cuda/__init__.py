"""Triton kernels for NVIDIA GPUs (and CPU tensors under TRITON_INTERPRET=1).

One kernel family per module, no model or backend imports. Every public launcher counts its launches
in `LAUNCHES` so callers can prove a kernel ran.
"""

from kernels_cuda._launches import LAUNCHES, count_launch, interpreter_active

if interpreter_active():
    from kernels_cuda._interpreter_compat import apply as _apply_interpreter_compat

    _apply_interpreter_compat()

__all__ = ["LAUNCHES", "count_launch", "interpreter_active"]
