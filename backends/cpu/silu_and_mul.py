"""cpu backend: silu_and_mul (SPEC 2.10), the reference's fp32 formula with no fp32 copy of `up` and the
products in place (bitwise the reference: the same fp32 products in the same order); backward from x."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    g = x[:, :n].float()
    if invariant.active():  # SPEC 12: the reference's fixed formula, bitwise
        return (invariant.silu(g) * x[:, n:].float()).to(x.dtype)
    return torch.sigmoid(g).mul_(g).mul_(x[:, n:]).to(x.dtype)  # (s * g) * up == (g * s) * up, bitwise


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor]:
    x = args["x"]
    n = x.shape[1] // 2
    g, dy = x[:, :n].float(), grad_outputs[0].float()
    s = torch.sigmoid(g)
    dx = torch.empty(x.shape, dtype=x.dtype)
    # d gate = dy * up * s * (1 + g * (1 - s)); d up = dy * g * s: the reference's products, in its order
    dx[:, :n] = dy * x[:, n:].float() * s * (1 + g * (1 - s))
    dx[:, n:] = dy * g * s
    return (dx,)


# not batch_invariant, as the reference: torch's sigmoid (vector exp in a buffer's body, scalar in its tail);
# layout_invariant: in the mode, the reference's fixed formula
IMPL = OpImpl(
    silu_and_mul,
    OpCaps(FLOATS, batch_invariant=False, differentiable=True, layout_invariant=True),
    backward=backward,
)
