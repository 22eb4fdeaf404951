"""Launch counting, interpreter detection and the physical core count that sizes every grid."""

from __future__ import annotations

import os
from collections import Counter

LAUNCHES: Counter[str] = Counter()

# Under the interpreter there is no device to ask; these are an Atlas A2 (910B3-class) chip's counts,
# so the interpreted grid has the same shape as on hardware.
_INTERPRETED_CORES = {"aicore": 20, "vectorcore": 40}


def count_launch(family: str, n: int = 1) -> None:
    LAUNCHES[family] += n


def interpreter_active() -> bool:
    """TRITON_INTERPRET is read when @triton.jit decorates a kernel: it must be set before import."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_cores(kind: str) -> int:
    """Physical core count: "aicore" (cube + 2 vector units; kernels with tl.dot) or "vectorcore"."""
    if kind not in _INTERPRETED_CORES:
        raise ValueError(f"kind: expected 'aicore' or 'vectorcore', got {kind!r}")
    if interpreter_active():
        return _INTERPRETED_CORES[kind]
    import torch
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(torch.npu.current_device())
    return int(props["num_aicore" if kind == "aicore" else "num_vectorcore"])
