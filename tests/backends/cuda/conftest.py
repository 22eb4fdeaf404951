"""Tests of the cuda backend: on a CUDA device when one is visible, else Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when @triton.jit decorates a kernel, so it is set here, before any test module
imports kernels_cuda, and then checked: a kernel module imported earlier without it would hand CPU tensors
to compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kernels_cuda  # noqa: E402  (after the switch above, on purpose)
from kernels_cuda import interpreter_active  # noqa: E402

INTERPRETED = interpreter_active()
DEVICE = "cpu" if INTERPRETED else "cuda"


def _check_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels_cuda.topk import _topk_kernel

    if INTERPRETED != isinstance(_topk_kernel, InterpretedFunction):
        raise RuntimeError(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} but kernels_cuda.topk was "
            "decorated in the other mode: it was imported before tests/backends/cuda/conftest.py"
        )


_check_interpreted()


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def cuda():
    """The `cuda` backend (interpreted on CPU tensors when no GPU is visible)."""
    import backends

    return backends.get("cuda")


@pytest.fixture
def launches():
    """Kernel launches per family since the test started."""
    before = kernels_cuda.LAUNCHES.copy()
    return lambda: kernels_cuda.LAUNCHES - before


def skip_bf16_interpreted(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip(
            "bfloat16 arithmetic is not reliable in Triton's interpreter (NumPy has no bf16): device-only"
        )
