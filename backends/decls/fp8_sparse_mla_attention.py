"""fp8_sparse_mla_attention (SPEC 7.7): sparse MLA attention on the 656-byte FP8 cache (FlashMLA's)."""

from __future__ import annotations

import torch
from torch import Tensor

from backends import validation_fp8 as v8
from backends.decl import OpDecl
from backends.decls import _sized
from backends.decls._common import FLOATS, attention_fake, attention_returns, dtype_of, randn
from backends.decls.sparse_mla_attention import QUANTITIES
from backends.layout import SeqLayout


def fp8_sparse_mla_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """q [T, H, 576], kv_cache uint8 ragged [rows, 656] / paged [nb, bs, 656], d_v 512
    -> (out [T, H, 512] dtype of q, lse fp32 [T, H] or None)."""


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant

    return dict(
        q=randn(g, 2, 2, 576, dtype=dt),
        kv_cache=fp8_mla_cache_quant(randn(g, 4, 576) / 10),
        indices=torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
        layout=SeqLayout.from_lengths([2], [4]),
        sm_scale=0.5,
        d_v=512,
        return_lse=True,
    )


DECL = OpDecl(
    name="fp8_sparse_mla_attention",
    spec_section="7.7",
    signature=fp8_sparse_mla_attention,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=v8.check_fp8_sparse_mla_attention,
    values=v8.values_fp8_sparse_mla_attention,
    fake=attention_fake,
    sample=sample,
    sized=_sized.fp8_attention,
    sharding="heads local",
    cache_arg="kv_cache",
    quantities={q: QUANTITIES[q] for q in ("heads", "topk")},  # the 656-byte rows fix d_qk and d_v
    returns=attention_returns,
)
