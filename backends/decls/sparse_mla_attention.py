"""sparse_mla_attention (SPEC 2.4): absorbed-MLA attention over the keys each query's indices name."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from backends import validation as v
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import (
    FLOATS,
    LONG_BLOCKS,
    attention_fake,
    attention_returns,
    dim,
    dtype_of,
    long_layout,
    randn,
)
from backends.layout import SeqLayout


def sparse_mla_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """q [T, H, d_qk], kv_cache ragged [rows, d_qk] / paged [nb, bs, d_qk], indices int32 [T, topk]
    -> (out [T, H, d_v] dtype of q, lse fp32 [T, H] or None)."""


def before_backward(run: Callable, args: dict, outputs: tuple, grads: tuple) -> tuple:
    """From the saved out and lse. The front door makes the forward return lse whenever a gradient will
    be taken (`OpImpl.backward_forces`); only a direct call with return_lse=False gets its lse here, from
    one more forward."""
    asked = args["return_lse"]
    args = {**args, "return_lse": True}
    if not (asked and outputs[1].numel()):
        outputs = run(args)
    return args, outputs, (grads[0], grads[1] if asked else None)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        q=randn(g, 4, 2, 40, dtype=dt, grad=grad),
        kv_cache=randn(g, LONG_BLOCKS, 64, 40, dtype=dt, grad=grad),
        indices=torch.randint(-1, 2100, (4, 64), generator=g, dtype=torch.int32),  # of 2100 keys
        layout=long_layout(),
        sm_scale=0.15,
        d_v=32,
        return_lse=True,
    )


QUANTITIES = {
    "heads": dim("q", 1),
    "d_qk": dim("q", 2),
    "d_v": lambda a: a["d_v"],
    "d_qk_minus_d_v": lambda a: a["q"].shape[2] - a["d_v"],
    "topk": dim("indices", 1),
}

DECL = OpDecl(
    name="sparse_mla_attention",
    spec_section="2.4",
    signature=sparse_mla_attention,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=v.check_sparse_mla_attention,
    values=v.values_sparse_mla_attention,
    fake=attention_fake,
    sample=sample,
    sized=_sized.attention,
    sharding="heads local",
    cache_arg="kv_cache",
    grad_args=("q", "kv_cache"),
    saves_outputs=True,
    quantities=QUANTITIES,
    returns=attention_returns,
    before_backward=before_backward,
)
