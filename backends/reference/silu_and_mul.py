"""SwiGLU's activation on a fused gate-up projection (SPEC 2.10; vLLM `SiluAndMul`, SGLang `silu_and_mul`).

x [M, 2N] = [gate | up] -> out [M, N] = silu(gate) * up, in fp32, rounded once to the dtype of x,
silu(g) = g * sigmoid(g). Backward (from x alone): with s = sigmoid(g),
d gate = dy * up * s * (1 + g * (1 - s)), d up = dy * g * s, both in fp32, rounded once to the dtype of x.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[1] // 2
    return x[:, :n].float(), x[:, n:].float()


@reference_op("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    g, u = _halves(x)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def silu_and_mul_backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor]:
    x, dy = args["x"], grad_outputs[0].float()
    g, u = _halves(x)
    s = torch.sigmoid(g)
    d_gate = dy * u * s * (1 + g * (1 - s))
    d_up = dy * g * s
    return (torch.cat([d_gate, d_up], dim=1).to(x.dtype),)


#: not batch_invariant: torch's CPU sigmoid takes a vector exp in the body of a buffer and the scalar one in
#: its tail, so an element's last bit may depend on where its row starts
IMPL = OpImpl(
    silu_and_mul, OpCaps(FLOATS, batch_invariant=False, differentiable=True), backward=silu_and_mul_backward
)
