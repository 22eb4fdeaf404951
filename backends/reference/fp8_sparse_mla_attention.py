"""Sparse MLA attention on FlashMLA's V3.2 FP8 latent cache (SPEC 7.7; FlashMLA
`flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`).

kv_cache uint8 ragged [rows, 656] or paged [nb, bs, 656] (rows written by `fp8_mla_cache_quant`);
q [T, H, 576] float, d_v = 512. Each indexed row is de-quantized as FlashMLA's SM90 kernel does
(`fp8_format.mla_dequantize_rows`):
    K_j[:512] = bf16( bf16(fp8_j) * bf16(scale_j[i // 128]) ),   K_j[512:] = k_pe_j (bf16)
then the attention of SPEC 2.4 runs on K in fp32:
    p[t,h,j] = sm_scale * dot(q[t,h], K_j);  lse = logsumexp_j p;  out[t,h] = sum_j exp(p - lse) K_j[:512]
    empty valid(t): out = 0, lse = -inf.   Only rows named by a valid index are read.
"""

from __future__ import annotations

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.decls._common import FLOATS
from backends.layout import SeqLayout
from backends.reference._cache import gather_rows
from backends.reference.fp8_format import mla_dequantize_rows


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


IMPL = OpImpl(fp8_sparse_mla_attention, OpCaps(FLOATS, FP8_KINDS))
