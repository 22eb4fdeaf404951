"""Sparse MLA attention on FlashMLA's V3.2 FP8 latent cache (SPEC 7.7; FlashMLA
`flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`).

kv_cache uint8 ragged [rows, 656] or paged [nb, bs, 656] (rows written by `fp8_mla_cache_quant`);
q [T, H, 576] float, d_v = 512. Each indexed row is de-quantized as FlashMLA's SM90 kernel does
(`fp8_format.mla_dequantize_rows`):
    K_j[:512] = bf16( bf16(fp8_j) * bf16(scale_j[i // 128]) ),   K_j[512:] = k_pe_j (bf16)
then the attention of SPEC 2.4 runs on K in fp32:
    p[t,h,j] = sm_scale * dot(q[t,h], K_j);  lse = logsumexp_j p;  out[t,h] = sum_j exp(p - lse) K_j[:512]
    empty valid(t): out = 0, lse = -inf.   Only rows named by a valid index are read.
This module is the op's declaration too (`DECL`: the function below is the signature; validators, fake,
sized builder, sample).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, _shape, check_same_device, check_tensor, fail
from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.layout import SeqLayout, check_cache, check_layout
from backends.reference._cache import gather_rows
from backends.reference._common import FLOATS, attention_fake, attention_returns, dim, dtype_of, randn
from backends.reference.fp8_format import MLA_D_QK, MLA_D_V, MLA_ROW_BYTES, mla_dequantize_rows
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant


@reference_op("fp8_sparse_mla_attention")
def fp8_sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, 576], kv_cache uint8 ragged [rows, 656] / paged [nb, bs, 656], d_v 512
    -> (out [T, H, 512] dtype of q, lse fp32 [T, H] or None)."""
    t, h, d_qk = q.shape
    n_idx = indices.shape[1]
    out = torch.zeros(t, h, d_v, dtype=torch.float32)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32)
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        for a in range(q0, q1):  # one query at a time: [H, topk] scores
            idx = indices[a].to(torch.int64)
            valid = (idx >= 0) & (idx < s)
            if not valid.any():
                continue
            keys = torch.zeros(n_idx, d_qk, dtype=torch.float32)
            keys[valid] = mla_dequantize_rows(gather_rows(kv_cache, layout, b, idx[valid])).float()
            p = (q[a].float() @ keys.T) * sm_scale  # [H, topk]
            p = p.masked_fill(~valid[None, :], float("-inf"))
            lse[a] = torch.logsumexp(p, dim=-1)
            out[a] = torch.exp(p - lse[a][:, None]) @ keys[:, :d_v]
    return out.to(q.dtype), (lse if return_lse else None)


def check(q, kv_cache, indices, layout, sm_scale, d_v, return_lse) -> None:
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    t = q.shape[0]
    if q.shape[2] != MLA_D_QK:
        fail("q", f"shape [T, H, {MLA_D_QK}] (FlashMLA V3.2 FP8 cache)", f"shape {_shape(q)}")
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=(2, 3))
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != t:
        fail("indices", f"shape [T={t}, topk]", f"shape {_shape(indices)}")
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    check_layout(layout, t, kv_cache, "kv_cache")
    check_cache("kv_cache", kv_cache, layout, MLA_ROW_BYTES, torch.uint8)
    if (
        isinstance(sm_scale, bool)
        or not isinstance(sm_scale, (int, float))
        or not abs(sm_scale) < float("inf")
    ):
        fail("sm_scale", "a finite float", sm_scale)
    if d_v != MLA_D_V:
        fail("d_v", f"{MLA_D_V} (the latent width of the FP8 cache)", d_v)
    if not isinstance(return_lse, bool):
        fail("return_lse", "a bool", type(return_lse).__name__)


def values(q, kv_cache, indices, layout, sm_scale, d_v, return_lse) -> None:
    layout.check(q.shape[0], kv_cache, "kv_cache")


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        q=randn(g, 2, 2, 576, dtype=dt),
        kv_cache=fp8_mla_cache_quant(randn(g, 4, 576) / 10),
        indices=torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
        layout=SeqLayout.from_lengths([2], [4]),
        sm_scale=0.5,
        d_v=512,
        return_lse=True,
    )


KEYS = 2100  # > 2048: below it sparse attention equals dense and hides bugs


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """The 656-byte cache fixes d_qk 576 and d_v 512: heads and topk are what vary."""
    dt = dt if dt in FLOATS else "float32"
    h = v if quantity == "heads" else 2
    topk = v if quantity == "topk" else 2048
    keys = max(KEYS, topk + 5)
    lay = SeqLayout.from_lengths([2], [keys], block_size=64)
    rows = fp8_mla_cache_quant(torch.randn(-(-keys // 64) * 64, 576, generator=g) / 10)
    idx = torch.randint(-1, keys, (2, topk), generator=g, dtype=torch.int32)
    return dict(
        q=randn(g, 2, h, 576, dtype=dt),
        kv_cache=rows.reshape(-1, 64, 656),
        indices=idx,
        layout=lay,
        sm_scale=576**-0.5,
        d_v=512,
        return_lse=True,
    )


DECL = OpDecl(
    name="fp8_sparse_mla_attention",
    spec_section="7.7",
    signature=fp8_sparse_mla_attention,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=attention_fake,
    sample=sample,
    sized=sized,
    sharding="heads local",
    cache_arg="kv_cache",
    quantities={"heads": dim("q", 1), "topk": dim("indices", 1)},  # the 656-byte rows fix d_qk and d_v
    returns=attention_returns,
)
IMPL = OpImpl(fp8_sparse_mla_attention, OpCaps(FLOATS, FP8_KINDS))
