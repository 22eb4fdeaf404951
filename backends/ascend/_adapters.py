"""Plain-torch conversions between the contract's layouts (SPEC 1) and torch_npu's (TND / PA_BSND,
cumulative vs per-request lengths, valid-first index lists, padded head counts, (max, sum) softmax
statistics, int4 packed along N). Each is one small function so tests can break exactly one.
"""

from __future__ import annotations

import torch

from backends.cache_layout import MLAPools
from backends.formats import unpack_int4
from backends.layout import SeqLayout


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """Per-request lengths [B] -> prefix sums [B] int32 (the TND convention: entry b ends segment b)."""
    return torch.cumsum(lengths.to(torch.int64), 0).to(torch.int32)


def query_lengths_tnd(layout: SeqLayout) -> torch.Tensor:
    """`actual_seq_lengths_query` for a TND query: cumulative, i.e. cu_seqlens_q[1:]."""
    return layout.cu_seqlens_q[1:].contiguous()


def key_lengths_pa(layout: SeqLayout) -> torch.Tensor:
    """`actual_seq_lengths_key` for a PA_BSND key: per-request lengths (not cumulative)."""
    return layout.seqlens_k.contiguous()


def pad_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Zero-pad axis 1 (heads) of [T, H, ...] to `heads`. Zero query heads with zero weights add nothing."""
    h = t.shape[1]
    if h == heads:
        return t.contiguous()
    pad = t.new_zeros((t.shape[0], heads - h, *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


def token_request(layout: SeqLayout, t: int | None = None) -> torch.Tensor:
    """[T] int64: the request each query token belongs to (a search, so no host read when T is given)."""
    t = layout.num_tokens if t is None else t
    tok = torch.arange(t, device=layout.device, dtype=torch.int32)
    return torch.searchsorted(layout.cu_seqlens_q[1:], tok, right=True).to(torch.int64)


def causal_visible(layout: SeqLayout) -> torch.Tensor:
    """[T] int32: how many keys each query may see (right-down causality, SPEC 1)."""
    t_req = token_request(layout)
    cu_q = layout.cu_seqlens_q.to(torch.int64)
    s = layout.seqlens_k.to(torch.int64)[t_req]
    i = torch.arange(t_req.shape[0], device=t_req.device) - cu_q[t_req]
    t_b = (cu_q[1:] - cu_q[:-1])[t_req]
    return (s - t_b + i + 1).clamp(min=0).minimum(s).to(torch.int32)


def valid_first(indices: torch.Tensor, seqlen_of_token: torch.Tensor) -> torch.Tensor:
    """Logical indices [T, K] -> same entries with every invalid one (negative or >= the request's
    seqlen_k) replaced by -1 and moved after the valid ones, which keep their order: SFA reads its
    index list up to the first -1."""
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < seqlen_of_token[:, None].to(torch.int64))
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.where(valid.gather(1, order), idx.gather(1, order), -1).to(torch.int32)


def lse_from_softmax_stats(softmax_max: torch.Tensor, softmax_sum: torch.Tensor, heads: int) -> torch.Tensor:
    """SFA's (softmax_max, softmax_sum) [N2=1, T, N1] -> natural-log lse [T, heads], padding dropped."""
    return (softmax_max[0, :, :heads] + torch.log(softmax_sum[0, :, :heads])).float()


def physical_rows(layout: SeqLayout, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `cache.flatten(0, -2)` holding each request's logical keys 0..seqlens_k[b]-1, concatenated
    request by request: (rows int64 [sum seqlens_k], start int64 [B] of each request in `rows`)."""
    parts = []
    for b, (_, _, s) in enumerate(layout.request_bounds()):
        parts.append(layout.physical_rows(b, torch.arange(s, dtype=torch.int64), cache))
    rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    start = torch.cumsum(layout.seqlens_k.to(torch.int64), 0) - layout.seqlens_k.to(torch.int64)
    return rows.to(cache.device), start.to(cache.device)


def compact_keys(layout: SeqLayout, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A TND key: each request's keys 0..s_b-1 packed back to back, [sum s_b, D], and the cumulative
    `actual_seq_lengths_*` that delimit them. Zero-copy for a ragged cache that is already packed."""
    if layout.kind == "ragged":
        cu_k = layout.host()["cu_k"]
        packed = [0] + cumulative(layout.seqlens_k).tolist()
        if cu_k == packed:
            return cache[: cu_k[-1]], cumulative(layout.seqlens_k)
    rows, _ = physical_rows(layout, cache)
    if isinstance(cache, MLAPools):
        return cache.rows(rows), cumulative(layout.seqlens_k)
    return cache.reshape(-1, cache.shape[-1]).index_select(0, rows), cumulative(layout.seqlens_k)


def selected_rows(
    layout: SeqLayout, cache: torch.Tensor, idx: torch.Tensor, t_req: torch.Tensor
) -> torch.Tensor:
    """Valid-first logical indices idx [T, K] (-1 = none) -> int64 [T, K] rows of `cache.flatten(0, -2)`
    (row 0 where idx < 0: read by nobody, the index list stops there). Tensor ops only: no host read."""
    pos = idx.to(torch.int64).clamp(min=0)
    if layout.kind == "paged":
        bs = cache.shape[1]
        blk = layout.block_table.to(torch.int64)[t_req[:, None], pos // bs]
        rows = blk * bs + pos % bs
    else:
        rows = layout.cu_seqlens_k.to(torch.int64)[t_req][:, None] + pos
    return torch.where(idx >= 0, rows, 0)


def selected_keys(
    layout: SeqLayout, cache: torch.Tensor, idx: torch.Tensor, t_req: torch.Tensor, d_nope: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TND key made of each query token's own selected rows: token t is request t of the operator call,
    its K = idx.shape[1] keys are the rows idx[t] names, in order, so its index list becomes 0..n_t-1.
    Copies T*K rows (what the operator reads anyway), whatever the context length: the cost of the
    whole-request compaction without the O(seqlen) part.

    idx: valid-first logical indices [T, K]. Returns (key [T*K, 1, d_nope], key_rope [T*K, 1, D - d_nope],
    both contiguous, cumulative query lengths [T] = 1..T, cumulative key lengths [T] = K, 2K, ..,
    indices int32 [T, K] = 0..K-1 where idx >= 0 else -1)."""
    t, k = idx.shape
    if isinstance(cache, MLAPools):
        nope, rope = cache.latent.flatten(0, -2), cache.rope.flatten(0, -2)
    else:
        flat = cache.reshape(-1, cache.shape[-1])
        nope, rope = flat[:, :d_nope], flat[:, d_nope:]
    rows = selected_rows(layout, cache, idx, t_req).reshape(-1)
    key = nope.index_select(0, rows)[:, None]  # contiguous: one copy of the selected rows
    key_rope = rope.index_select(0, rows)[:, None]
    steps = torch.arange(1, t + 1, dtype=torch.int32, device=idx.device)
    slots = torch.arange(k, dtype=torch.int32, device=idx.device).expand(t, k)
    local = torch.where(idx >= 0, slots, -1).contiguous()
    return key, key_rope, steps, steps * k, local


def pack_int4_along_n(w: torch.Tensor) -> torch.Tensor:
    """Signed int4 values int8 [..., K, N] (N a multiple of 8) -> int32 [..., K, N/8], element 8j+i in
    bits 4i..4i+3 (torch_npu's int4-in-int32 convention; little-endian nibbles)."""
    if w.shape[-1] % 8:
        raise ValueError(f"w: expected a last dim that is a multiple of 8, got shape {list(w.shape)}")
    nib = (w.to(torch.int32) & 0xF).reshape(*w.shape[:-1], w.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    packed = (nib.to(torch.int64) << shifts.to(torch.int64)).sum(-1)  # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def repack_w4_for_npu(
    w_packed: torch.Tensor, w_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Canonical per-channel W4 weights -> what npu_grouped_matmul's int4 path takes.

    w_packed uint8 [E, N, K//2], w_scale fp32 [E, N] ->
    (weight int32 [E, K, N8/8] packed along N, scale int64 [E, N8] holding the fp32 bits,
     scale_bias fp32 [E, N8] = 8 * sum_k w * scale (the cube's int4-split offset), N8 = N rounded up to 8).
    Padded output channels have zero weights and zero scale and are sliced off by the caller.
    """
    w = unpack_int4(w_packed)  # [E, N, K] int8
    e, n, k = w.shape
    n8 = -(-n // 8) * 8
    if n8 != n:
        w = torch.cat([w, w.new_zeros((e, n8 - n, k))], dim=1)
        w_scale = torch.cat([w_scale, w_scale.new_zeros((e, n8 - n))], dim=1)
    weight = pack_int4_along_n(w.transpose(1, 2).contiguous())  # [E, K, N8/8]
    scale_bits = w_scale.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    scale_bias = 8.0 * w.to(torch.float32).sum(dim=2) * w_scale.float()  # [E, N8]
    return weight, scale_bits, scale_bias, n8
