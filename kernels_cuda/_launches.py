"""Launch counting and interpreter detection shared by the kernel modules."""

from __future__ import annotations

import os
from collections import Counter

LAUNCHES: Counter[str] = Counter()


def count_launch(family: str, n: int = 1) -> None:
    LAUNCHES[family] += n


def interpreter_active() -> bool:
    """True when Triton's interpreter is on. It is read when @triton.jit decorates a function, so it must
    be set before any kernel module is imported; backends.cuda checks the kernels really are interpreted."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
