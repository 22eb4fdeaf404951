"""SwiGLU's activation on a fused gate-up projection (SPEC 2.10; vLLM `SiluAndMul`, SGLang `silu_and_mul`).

x [M, 2N] = [gate | up] -> out [M, N] = silu(gate) * up, in fp32, rounded once to the dtype of x,
silu(g) = g * sigmoid(g). Backward (from x alone): with s = sigmoid(g),
d gate = dy * up * s * (1 + g * (1 - s)), d up = dy * g * s, both in fp32, rounded once to the dtype of x.
In the layout-invariant mode (SPEC 12) silu is the mode's fixed formula g / (1 + e^-g) in fp32
(`backends.invariant.engine.silu`, the bits the mode gives a hand-written silu), times up, rounded once.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.invariant import engine as invariant
from backends.reference._common import FLOATS, dtype_of, randn


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[1] // 2
    return x[:, :n].float(), x[:, n:].float()


@reference_op("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] float = [gate | up] -> silu(gate) * up [M, N], dtype of x."""
    g, u = _halves(x)
    if invariant.active():  # SPEC 12: a fixed formula, so no element's bits depend on where it sits
        return (invariant.silu(g) * u).to(x.dtype)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def silu_and_mul_backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor]:
    x, dy = args["x"], grad_outputs[0].float()
    g, u = _halves(x)
    s = torch.sigmoid(g)
    d_gate = dy * u * s * (1 + g * (1 - s))
    d_up = dy * g * s
    return (torch.cat([d_gate, d_up], dim=1).to(x.dtype),)


def check(x) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    if x.shape[1] % 2:
        fail("x", "an even last dimension ([M, 2N]: gate then up)", f"shape {list(x.shape)}")


DECL = OpDecl(
    name="silu_and_mul",
    spec_section="2.10",
    signature=silu_and_mul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=check,
    fake=lambda a: a["x"].new_empty((a["x"].shape[0], a["x"].shape[1] // 2)),
    sample=lambda g, dt, grad: dict(x=randn(g, 7, 2 * 96, dtype=dt, grad=grad)),
    sharding="columns or rows local",  # the rank's I / tp columns of gate and of up, side by side
    grad_args=("x",),
    quantities={"N": lambda a: a["x"].shape[1] // 2},
    sized=lambda g, dt, quantity, n: dict(x=randn(g, 3, 2 * n, dtype=dt)),
)
#: not batch_invariant: torch's CPU sigmoid takes a vector exp in the body of a buffer and the scalar one in
#: its tail, so an element's last bit may depend on where its row starts; layout_invariant: the mode's
#: fixed formula instead
IMPL = OpImpl(
    silu_and_mul,
    OpCaps(FLOATS, batch_invariant=False, differentiable=True, layout_invariant=True),
    backward=silu_and_mul_backward,
)
