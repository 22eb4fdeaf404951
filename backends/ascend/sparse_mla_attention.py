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
  pool. So the backend declares split pools (`mla_cache`, backends/cache_layout.py: latent
  [blocks, 128, 1, 512] and rope [blocks, 128, 1, 64], as vllm-ascend stores them) and
  * split pools, return_lse=False (what the model asks): the pools go to the operator as PA_BSND
    key/key_rope with the layout's block table, no cache copy at all; with return_lse=True (the
    operator gives no lse in PA_BSND) the selected-rows / whole-request routes above, from the pools;
- indices: logical positions kept, every invalid entry (-1 or >= seqlen_k) set to -1 and moved to the
  end (the operator reads up to the first -1);
- `attention_mode=2` (MLA absorbed, key is value), `sparse_mode=0` (the indices decide; no extra causal
  mask), `return_softmax_lse=True`; lse = softmax_max + log(softmax_sum), from `[1, T, N1]` to [T, H];
- a row with no valid index: out = 0, lse = -inf (the operator leaves it undefined).
Other shapes (the operator fixes D = 512, Dr = 64), fp32 and head counts past the SoC's set go to
kernels_ascend.sparse_mla_attention, with logical indices turned into physical rows (-1 = skip).

In the layout-invariant mode (SPEC 12) neither the operator nor the kernel runs (npu_sparse_flash_attention
has no exact mode): per block of query tokens, the named rows are gathered (`kernel_rows`; split pools
joined) and `exact_attention` composes torch ops with the exact product on the "ascend" engine
(kernels_ascend.invariant_gemm: int8 digit products in int32): exact scores scaled after the product,
-inf where invalid, the fixed-tree log-sum-exp, the formula exp, exact probabilities x values.
Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._provider import BATCH_INVARIANT, OpsProvider
from backends.ascend._soc import BLOCK_MULTIPLE, MAX_BLOCK
from backends.cache_layout import MLACacheLayout, MLAPools
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant
from backends.invariant.attention import exact_attention

OP = "npu_sparse_flash_attention"
D_NOPE, D_ROPE = 512, 64
#: the paged latent cache the operator reads with no copy (PA_BSND pools; vllm-ascend's block size)
CACHE_LAYOUT = MLACacheLayout(split=(D_NOPE, D_ROPE), block_size=128)


def _pa_bsnd(kv_cache, return_lse: bool) -> bool:
    """Split pools the operator reads in place: PA_BSND gives no lse, and takes documented block sizes."""
    if return_lse or not isinstance(kv_cache, MLAPools):
        return False
    bs = kv_cache.shape[1]
    dense = kv_cache.latent.is_contiguous() and kv_cache.rope.is_contiguous()
    return dense and bs % BLOCK_MULTIPLE == 0 and 0 < bs <= MAX_BLOCK


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


#: the mode's gathered [tq, topk, d_qk] fp32 keys per block of query tokens (elements)
EXACT_GATHER_ELEMS = 1 << 22


def exact_route(q, kv_cache, indices, layout, sm_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 12's attention (out [T, H, d_v] dtype of q, lse fp32 [T, H]): each block of query tokens'
    named rows gathered as fp32 (invalid ones zero), then `exact_attention` on the "ascend" engine."""
    t, h, d_qk = q.shape
    n = indices.shape[1]
    out = torch.zeros((t, h, d_v), device=q.device)
    lse = torch.full((t, h), float("-inf"), device=q.device)
    if n == 0 or kv_cache.shape[:-1].numel() == 0:  # no key to read: every row empty
        return out.to(q.dtype), lse
    rows = kernel_rows(layout, kv_cache, indices)  # [T, topk] physical rows, -1 where invalid
    valid = rows >= 0
    step = max(1, EXACT_GATHER_ELEMS // (n * d_qk))
    for a in range(0, t, step):
        z = min(a + step, t)
        r = rows[a:z].clamp(min=0).reshape(-1).to(torch.int64)
        keys = kv_cache.rows(r) if isinstance(kv_cache, MLAPools) else kv_cache.reshape(-1, d_qk)[r]
        keys = keys.view(z - a, n, d_qk).float().masked_fill(~valid[a:z, :, None], 0)
        out[a:z], lse[a:z] = exact_attention(q[a:z].float(), keys, valid[a:z], d_v, sm_scale, engine="ascend")
    return out.to(q.dtype), lse


def _compaction_cheaper(layout, t: int, k: int) -> bool:
    """Whole-request packing copies sum(seqlens_k) rows, selected rows T * K: pick the smaller. Decided
    from host ints where they settle it (max_seqlen_k), else from the layout's host copy."""
    if t * k <= layout.seqlen_k_max():  # <= max <= sum: selected rows never copy more
        return False
    return sum(layout.host()["seqlens_k"]) < t * k


def impl(provider: OpsProvider) -> OpImpl:
    def sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        if invariant.active():
            provider.record(
                "sparse_mla_attention", "layout-invariant: " + provider.kernel_label("invariant_gemm")
            )
            out, lse = exact_route(q, kv_cache, indices, layout, sm_scale, d_v)
            return out, (lse if return_lse else None)
        if operator_reasons(provider, q, d_v):
            from kernels_ascend.sparse_mla_attention import sparse_mla_attention as kernel

            provider.record("sparse_mla_attention", provider.kernel_label("sparse_mla_attention"))
            rows = kernel_rows(layout, kv_cache, indices)
            if isinstance(kv_cache, MLAPools):  # the kernel reads one [rows, D] tensor: the named rows
                keys = kv_cache.rows(rows.clamp(min=0).reshape(-1).to(torch.int64))
                slots = torch.arange(rows.numel(), dtype=torch.int32, device=rows.device).view_as(rows)
                out, lse = kernel(q, keys, torch.where(rows >= 0, slots, -1), sm_scale, d_v)
                return out, (lse if return_lse else None)
            out, lse = kernel(q, kv_cache.reshape(-1, kv_cache.shape[-1]), rows, sm_scale, d_v)
            return out, (lse if return_lse else None)
        return _operator(q, kv_cache, indices, layout, sm_scale, return_lse)

    def _operator(q, kv_cache, indices, layout, sm_scale, return_lse):
        t, h, _ = q.shape
        heads = provider.soc.pad_heads(provider.soc.sfa_heads, h)
        t_req = ad.token_request(layout, t)
        idx = ad.valid_first(indices, layout.seqlens_k.to(torch.int64)[t_req])  # [T, K] valid first
        empty = (idx < 0).all(dim=1)[:, None]  # no valid index at all (also topk = 0)
        if kv_cache.shape[:-1].numel() == 0:  # no key anywhere: nothing to read
            out = q.new_zeros((t, h, D_NOPE))
            return out, (torch.full((t, h), float("-inf"), device=q.device) if return_lse else None)
        qp = ad.pad_heads(q, heads)
        if _pa_bsnd(kv_cache, return_lse):
            out, _, _ = provider.call(
                OP,
                qp[..., :D_NOPE].contiguous(),
                kv_cache.latent,  # PA_BSND [blocks, bs, 1, 512], also value: the pool itself
                kv_cache.latent,
                idx[:, None, :],
                float(sm_scale),
                block_table=layout.block_table,
                actual_seq_lengths_query=ad.query_lengths_tnd(layout),
                actual_seq_lengths_kv=ad.key_lengths_pa(layout),
                query_rope=qp[..., D_NOPE:].contiguous(),
                key_rope=kv_cache.rope,
                sparse_block_size=1,
                layout_query="TND",
                layout_kv="PA_BSND",
                sparse_mode=0,
                attention_mode=2,
                return_softmax_lse=False,
            )
            provider.record("sparse_mla_attention", f"{provider.label(OP)} (PA_BSND split pools, no copy)")
            return out[:, :h].masked_fill(empty[..., None], 0), None
        if _compaction_cheaper(layout, t, idx.shape[1]):
            route = "whole requests packed"
            keys, cum_k = ad.compact_keys(layout, kv_cache)  # [sum s_b, 576] (split pools: joined)
            key, key_rope = keys[:, None, :D_NOPE].contiguous(), keys[:, None, D_NOPE:].contiguous()
            cum_q = ad.query_lengths_tnd(layout)
        else:
            route = "selected rows"
            key, key_rope, cum_q, cum_k, idx = ad.selected_keys(layout, kv_cache, idx, t_req, D_NOPE)
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
            ("ragged", "paged", "pools"),
            batch_invariant=BATCH_INVARIANT,
            layout_invariant=True,  # the mode's route: exact_attention on the "ascend" engine
            notes={
                "operator": "bf16/fp16, d_qk=576, d_v=512, heads padded "
                "to the SoC's set; otherwise the kernel",
                "copies": "split pools without lse: none (PA_BSND); otherwise the operator's TND key: "
                "T * topk selected rows (decode) or the batch's keys (prefill), whichever is fewer; "
                "never the whole pool",
            },
        ),
    )
