"""linear_cross_entropy (SPEC 2.9): mean cross-entropy of h @ weight^T, the logits never whole."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, dim, dtype_of, randn


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """h [N, D] float, weight [V, D], targets int [N] -> the fp32 scalar loss (the custom op also returns
    the per-row lse [N] its backward reads)."""


def _fake(a: dict) -> tuple[Tensor, Tensor]:
    h = a["h"]
    return h.new_empty((), dtype=torch.float32), h.new_empty((h.shape[0],), dtype=torch.float32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        h=randn(g, 6, 32, dtype=dt, grad=grad),
        weight=randn(g, 50, 32, dtype=dt, grad=grad),
        targets=torch.tensor([1, 2, -100, 49, 0, 3]),
        ignore_index=-100,
    )


DECL = OpDecl(
    name="linear_cross_entropy",
    spec_section="2.9",
    signature=linear_cross_entropy,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("h"),
    validate=v.check_linear_cross_entropy,
    values=v.values_linear_cross_entropy,
    fake=_fake,
    sample=sample,
    sized=_sized.linear_cross_entropy,
    sharding="unsplit",
    grad_args=("h", "weight"),
    outputs=2,  # the custom op's (loss, lse [N] fp32): lse is what the backward reads (empty [0] without one)
    saves_outputs=True,
    nondiff_outputs=(1,),
    quantities={"vocab": dim("weight", 0)},
    returns=lambda a, out: out[0],
    unchecked=v.unchecked_linear_cross_entropy,
)
