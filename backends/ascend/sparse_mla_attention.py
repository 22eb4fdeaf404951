"""ascend backend: sparse_mla_attention (SPEC 2.4) -> torch_npu.npu_sparse_flash_attention.

Conversions (each in backends/ascend/_adapters.py):
- q [T, H, 576] -> query [T, N1, 512] + query_rope [T, N1, 64], heads zero-padded to a count the SoC
  accepts (A2/A3: a power of two <= 128); padded heads are dropped from the outputs;
- the cache -> a TND key [rows, 1, 512] + key_rope [rows, 1, 64], contiguous, by the cheaper of
  * selected rows (decode, MTP: T * topk <= the keys of the batch): each query token becomes its own
    operator request holding the topk rows its indices name (`selected_keys`), T * topk rows copied
    whatever the context length (2.4 MB per token per layer at topk 2048, bf16), and
  * whole requests (prefill: more selections than keys): each request's keys packed (`compact_keys`),
    sum(seqlens_k) rows copied, `actual_seq_lengths_kv` cumulative;
  both give softmax_max/sum, so lse costs nothing here and `return_lse=False` only skips returning it.
  Why not PA_BSND on the paged cache itself: the operator documents key and key_rope as contiguous
  [blocks, block_size, 1, 512] and [.., 64] tensors (ops-transformer's sparse_flash_attention README:
  "不支持非连续", no non-contiguous input), and the contract's cache interleaves the two in one
  576-wide row, so its 512 and 64 column views are strided; making them contiguous copies the whole
  pool. A zero-copy PA_BSND call needs a cache stored as two pools (as vllm-ascend stores it), which
  the contract's one-tensor `kv_cache` cannot express;
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
    t_req = ad.token_request(layout, indices.shape[0])
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < layout.seqlens_k.to(torch.int64)[t_req][:, None])
    rows = ad.selected_rows(layout, kv_cache, torch.where(valid, idx, -1), t_req)
    return torch.where(valid, rows, -1).to(torch.int32)


def _compaction_cheaper(layout, t: int, k: int) -> bool:
    """Whole-request packing copies sum(seqlens_k) rows, selected rows T * K: pick the smaller. Decided
    from host ints where they settle it (max_seqlen_k), else from the layout's host copy."""
    if t * k <= layout.seqlen_k_max():  # <= max <= sum: selected rows never copy more
        return False
    return sum(layout.host()["seqlens_k"]) < t * k


def impl(provider: OpsProvider) -> OpImpl:
    def sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        if operator_reasons(provider, q, d_v):
            from kernels_ascend.sparse_mla_attention import sparse_mla_attention as kernel

            provider.record("sparse_mla_attention", provider.kernel_label("sparse_mla_attention"))
            rows = kernel_rows(layout, kv_cache, indices)
            out, lse = kernel(q, kv_cache.reshape(-1, kv_cache.shape[-1]), rows, sm_scale, d_v)
            return out, (lse if return_lse else None)
        return _operator(q, kv_cache, indices, layout, sm_scale, return_lse)

    def _operator(q, kv_cache, indices, layout, sm_scale, return_lse):
        t, h, _ = q.shape
        heads = provider.soc.pad_heads(provider.soc.sfa_heads, h)
        t_req = ad.token_request(layout, t)
        idx = ad.valid_first(indices, layout.seqlens_k.to(torch.int64)[t_req])  # [T, K] valid first
        empty = (idx < 0).all(dim=1)[:, None]  # no valid index at all (also topk = 0)
        if kv_cache.reshape(-1, kv_cache.shape[-1]).shape[0] == 0:  # no key anywhere: nothing to read
            out = q.new_zeros((t, h, D_NOPE))
            return out, (torch.full((t, h), float("-inf"), device=q.device) if return_lse else None)
        if _compaction_cheaper(layout, t, idx.shape[1]):
            route = "whole requests packed"
            keys, cum_k = ad.compact_keys(layout, kv_cache)  # [sum s_b, 576]
            key, key_rope = keys[:, None, :D_NOPE].contiguous(), keys[:, None, D_NOPE:].contiguous()
            cum_q = ad.query_lengths_tnd(layout)
        else:
            route = "selected rows"
            key, key_rope, cum_q, cum_k, idx = ad.selected_keys(layout, kv_cache, idx, t_req, D_NOPE)
        qp = ad.pad_heads(q, heads)
        out, smax, ssum = provider.call(
            OP,
            qp[..., :D_NOPE].contiguous(),
            key,  # TND [rows, 1, 512], also value
            key,
            idx[:, None, :],
            float(sm_scale),
            actual_seq_lengths_query=cum_q,
            actual_seq_lengths_kv=cum_k,
            query_rope=qp[..., D_NOPE:].contiguous(),
            key_rope=key_rope,
            sparse_block_size=1,
            layout_query="TND",
            layout_kv="TND",
            sparse_mode=0,
            attention_mode=2,
            return_softmax_lse=return_lse,
        )
        provider.record("sparse_mla_attention", f"{provider.label(OP)} (TND, {route})")
        out = out[:, :h].masked_fill(empty[..., None], 0)
        if not return_lse:
            return out, None
        return out, ad.lse_from_softmax_stats(smax, ssum, h).masked_fill(empty, float("-inf"))

    return OpImpl(
        sparse_mla_attention,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            batch_invariant=BATCH_INVARIANT,
            notes={
                "operator": "bf16/fp16, d_qk=576, d_v=512, heads padded "
                "to the SoC's set; otherwise the kernel",
                "copies": "the operator's TND key: T * topk selected rows (decode) or the batch's "
                "keys (prefill), whichever is fewer; never the whole pool",
            },
        ),
    )
