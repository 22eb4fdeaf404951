"""ascend backend: silu_and_mul (SPEC 2.10) -> torch_npu.npu_swiglu (x split along its last dim: A = gate,
B = up; A * sigmoid(A) * B).

The operator takes no empty tensor: zero rows return an empty [0, N] without a call. Backward: the
contract's formula (backends/reference/silu_and_mul.py) in plain torch on the device, from x alone.
In the layout-invariant mode (SPEC 12) npu_swiglu does not run (its SwiGlu kernel is its own formula): the
mode's fixed silu formula (`invariant.silu`, fp32) times up, rounded once, as the reference's, in torch ops.
Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)
"""

from __future__ import annotations

import torch

from backends.ascend._provider import OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant

OP = "npu_swiglu"


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor]:
    x = args["x"]
    n = x.shape[1] // 2
    g, u, dy = x[:, :n].float(), x[:, n:].float(), grad_outputs[0].float()
    s = torch.sigmoid(g)
    return (torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], dim=1).to(x.dtype),)


def impl(provider: OpsProvider) -> OpImpl:
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, x.shape[1] // 2))
        if invariant.active():
            n = x.shape[1] // 2
            provider.record("silu_and_mul", "layout-invariant: the fixed silu formula (torch ops)")
            return (invariant.silu(x[:, :n].float()) * x[:, n:].float()).to(x.dtype)
        provider.record("silu_and_mul", provider.label(OP))
        return provider.call(OP, x.contiguous(), dim=-1)

    # torch_npu's SwiGlu kernel is its own: not claimed bitwise the reference nor batch-invariant; in the
    # mode the fixed formula instead
    return OpImpl(silu_and_mul, OpCaps(FLOATS, differentiable=True, layout_invariant=True), backward=backward)
