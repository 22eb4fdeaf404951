"""ascend backend: sparse_mla_attention (SPEC 2.4) -> torch_npu.npu_sparse_flash_attention.

Conversions (each in backends/ascend/_adapters.py):
- q [T, H, 576] -> query [T, N1, 512] + query_rope [T, N1, 64], heads zero-padded to a count the SoC
  accepts (A2/A3: a power of two <= 128); padded heads are dropped from the outputs;
- the cache -> TND key [sum s_b, 1, 512] + key_rope [sum s_b, 1, 64] (each request's keys packed,
  `actual_seq_lengths_kv` cumulative); the operator also takes PA_BSND, but documents
  `return_softmax_lse` for non-PA layouts only, and the contract always returns lse;
- indices: logical positions kept, every invalid entry (-1 or >= seqlen_k) set to -1 and moved to the
  end (the operator reads up to the first -1);
- `attention_mode=2` (MLA absorbed, key is value), `sparse_mode=0` (the indices decide; no extra causal
  mask), `return_softmax_lse=True`; lse = softmax_max + log(softmax_sum), from `[1, T, N1]` to [T, H];
- a row with no valid index: out = 0, lse = -inf (the operator leaves it undefined).
Other shapes (the operator fixes D = 512, Dr = 64), fp32 and head counts past the SoC's set go to
kernels_ascend.sparse_mla_attention, with logical indices turned into physical rows (-1 = skip).
Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._provider import BATCH_INVARIANT, OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.ops import FLOATS

OP = "npu_sparse_flash_attention"
D_NOPE, D_ROPE = 512, 64


def operator_reasons(provider: OpsProvider, q: torch.Tensor, d_v: int) -> list[str]:
    """Why npu_sparse_flash_attention cannot serve these inputs ([] if it can)."""
    why = []
    if q.dtype not in (torch.bfloat16, torch.float16):
        why.append(f"q dtype {q.dtype} (the operator takes bf16/fp16)")
    if q.shape[2] != D_NOPE + D_ROPE or d_v != D_NOPE:
        why.append(f"d_qk={q.shape[2]}, d_v={d_v} (the operator fixes D=512 + Dr=64, d_v=512)")
    if provider.soc.pad_heads(provider.soc.sfa_heads, q.shape[1]) is None:
        why.append(f"{q.shape[1]} heads (more than {provider.soc.name} allows)")
    return why


def kernel_rows(layout, kv_cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Logical indices [T, K] -> physical rows of kv_cache.flatten(0, -2), int32, -1 where invalid."""
    rows, start = ad.physical_rows(layout, kv_cache)
    t_req = ad.token_request(layout)
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < layout.seqlens_k.to(torch.int64)[t_req][:, None])
    flat = (start[t_req][:, None] + idx.clamp(min=0)).clamp(max=max(rows.shape[0] - 1, 0))
    phys = rows[flat] if rows.numel() else torch.zeros_like(flat)
    return torch.where(valid, phys, -1).to(torch.int32)


def impl(provider: OpsProvider) -> OpImpl:
    def sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        if operator_reasons(provider, q, d_v):
            from kernels_ascend.sparse_mla_attention import sparse_mla_attention as kernel

            provider.record("sparse_mla_attention", provider.kernel_label("sparse_mla_attention"))
            rows = kernel_rows(layout, kv_cache, indices)
            return kernel(q, kv_cache.reshape(-1, kv_cache.shape[-1]), rows, sm_scale, d_v)
        return _operator(q, kv_cache, indices, layout, sm_scale)

    def _operator(q, kv_cache, indices, layout, sm_scale):
        t, h, _ = q.shape
        heads = provider.soc.pad_heads(provider.soc.sfa_heads, h)
        keys, cum_k = ad.compact_keys(layout, kv_cache)  # [sum s_b, 576]
        seqlen = layout.seqlens_k.to(torch.int64)[ad.token_request(layout)]
        idx = ad.valid_first(indices, seqlen)  # [T, K] valid first, -1 last
        qp = ad.pad_heads(q, heads)
        key = keys[:, None, :D_NOPE].contiguous()  # TND [sum s_b, 1, 512], also value
        out, smax, ssum = provider.call(
            OP,
            qp[..., :D_NOPE].contiguous(),
            key,
            key,
            idx[:, None, :],
            float(sm_scale),
            actual_seq_lengths_query=ad.query_lengths_tnd(layout),
            actual_seq_lengths_kv=cum_k,
            query_rope=qp[..., D_NOPE:].contiguous(),
            key_rope=keys[:, None, D_NOPE:].contiguous(),
            sparse_block_size=1,
            layout_query="TND",
            layout_kv="TND",
            sparse_mode=0,
            attention_mode=2,
            return_softmax_lse=True,
        )
        provider.record("sparse_mla_attention", provider.label(OP))
        out, lse = out[:, :h], ad.lse_from_softmax_stats(smax, ssum, h)
        empty = (idx < 0).all(dim=1)[:, None]  # no valid index at all (also topk = 0)
        return out.masked_fill(empty[..., None], 0), lse.masked_fill(empty, float("-inf"))

    return OpImpl(
        sparse_mla_attention,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            batch_invariant=BATCH_INVARIANT,
            limits={
                "operator": "bf16/fp16, d_qk=576, d_v=512, heads padded "
                "to the SoC's set; otherwise the kernel"
            },
        ),
    )
