"""topk (SPEC 2.3): deterministic row-wise top-k (the MoE router's and the indexer's selection)."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, dim, dtype_of, randn, scalar


def topk(x: Tensor, k: int, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [R, C] float, lengths int [R] or None -> (values [R, k] dtype of x, indices int32 [R, k])."""


def _fake(a: dict) -> tuple[Tensor, Tensor]:
    x, k = a["x"], a["k"]
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(x=randn(g, 5, 3000, dtype=dt), k=64, lengths=torch.tensor([3000, 10, 0, 2999, 64]))


DECL = OpDecl(
    name="topk",
    spec_section="2.3",
    signature=topk,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=v.check_topk,
    values=v.values_topk,
    fake=_fake,
    sample=sample,
    sized=_sized.topk,
    sharding="replicated",
    quantities={"k": scalar("k"), "columns": dim("x", 1)},
    unchecked=v.unchecked_topk,
)
