"""cuda backend: silu_and_mul (SPEC 2.10) -> kernels_cuda.silu_and_mul (one launch forward, one backward;
to the default tolerance: Triton's exp). In the layout-invariant mode (SPEC 12): the reference's fixed
formula, silu(g) = g / (1 + e^-g) by `backends.invariant.engine.silu`, times up, in torch ops on the device
(bitwise the reference's)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)"""
    from kernels_cuda.silu_and_mul import silu_and_mul as kernel

    if invariant.active():
        n = x.shape[1] // 2
        return (invariant.silu(x[:, :n].float()) * x[:, n:].float()).to(x.dtype)
    return kernel(x)


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor]:
    from kernels_cuda.silu_and_mul import silu_and_mul_backward

    return (silu_and_mul_backward(args["x"], grad_outputs[0]),)


IMPL = OpImpl(silu_and_mul, OpCaps(FLOATS, differentiable=True, layout_invariant=True), backward=backward)
