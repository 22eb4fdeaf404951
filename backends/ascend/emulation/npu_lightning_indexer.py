"""EMULATION of `torch_npu.npu_lightning_indexer` (torch_npu 2.14; op-plugin docs and golden test).

Documented semantics: per query token, score_j = sum_h w_h * relu(q_h . k_j) over the N1 index heads
(the key has N2 = 1 head), fp32; sparse_mode=3 masks future keys right-down (query i of a request
with L_q queries sees key j <= L_kv - L_q + i); the top `sparse_count` key positions are returned as
int32 **logical positions inside the request**, output initialised to -1. The order among equal
scores is not documented (the golden uses an unstable sort): this emulation deliberately breaks ties
towards the HIGHER position, so a caller that needs a tie rule must impose it itself.

Layouts emulated: query TND `[T1, N1, 128]`; key PA_BSND `[blocks, block_size, 1, 128]` (with
`block_table`, `actual_seq_lengths_key` = per-request lengths) or TND `[T2, 1, 128]`
(`actual_seq_lengths_key` cumulative). `actual_seq_lengths_query` is cumulative for TND.
Documented limits enforced: bf16/fp16 query and key, D = 128, N2 = 1, N1 per SoC (A2/A3 <= 64;
950 in {8,16,24,32,64}), weights fp32 (not on 950) or the query dtype, block_size a multiple of 16
and <= 1024, contiguous key, sparse_count in [1, 2048] U {3072, ..., 8192}, sparse_mode in {0, 3},
pre/next_tokens default only, return_value only for non-PA layouts.
"""

from __future__ import annotations

import torch

from backends.ascend._soc import SOCS, SPARSE_COUNTS
from backends.ascend.emulation._checks import (
    NotEmulated,
    cumulative_bounds,
    need,
    need_dtype,
    need_int32_vector,
    need_pa_bsnd,
)

OP = "npu_lightning_indexer"
_INT64_MAX = 2**63 - 1


def npu_lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=_INT64_MAX,
    next_tokens=_INT64_MAX,
    return_value=False,
    _soc="A3",
):
    soc = SOCS[_soc]
    if layout_query != "TND" or layout_key not in ("PA_BSND", "TND"):
        raise NotEmulated(
            f"{OP}: layout_query={layout_query!r}, layout_key={layout_key!r} "
            "(emulated: query TND with key PA_BSND or TND)"
        )
    need_dtype(OP, "query", query, (torch.bfloat16, torch.float16))
    need(query.dim() == 3, OP, "query", "TND [T1, N1, D]", list(query.shape))
    t1, n1, d = query.shape
    need(d == 128, OP, "query", "head dim D = 128", d)
    need(n1 in soc.indexer_heads, OP, "query", f"N1 in {soc.name}'s supported head counts", n1)
    need(key.dtype == query.dtype, OP, "key", f"dtype {query.dtype} (as query)", key.dtype)
    need(key.is_contiguous(), OP, "key", "a contiguous tensor", "a strided view")
    wdt = (torch.float32, query.dtype) if soc.weights_fp32 else (query.dtype,)
    need_dtype(OP, "weights", weights, wdt)
    need(tuple(weights.shape) == (t1, n1), OP, "weights", f"[T1={t1}, N1={n1}]", list(weights.shape))
    need(sparse_count in SPARSE_COUNTS, OP, "sparse_count", "in [1, 2048] or {3072, ..., 8192}", sparse_count)
    need(sparse_mode in (0, 3), OP, "sparse_mode", "0 or 3", sparse_mode)
    need(
        pre_tokens == _INT64_MAX and next_tokens == _INT64_MAX,
        OP,
        "pre_tokens/next_tokens",
        "the defaults only",
        (pre_tokens, next_tokens),
    )
    need(not (return_value and layout_key == "PA_BSND"), OP, "return_value", "False with a PA_BSND key", True)

    cu_q = need_int32_vector(OP, "actual_seq_lengths_query", actual_seq_lengths_query).tolist()
    nb = len(cu_q)
    q_seg = cumulative_bounds(OP, "actual_seq_lengths_query", cu_q, t1)
    lens_k = need_int32_vector(OP, "actual_seq_lengths_key", actual_seq_lengths_key, nb).tolist()
    if layout_key == "PA_BSND":
        bs = need_pa_bsnd(OP, key, d)
        need(
            isinstance(block_table, torch.Tensor)
            and block_table.dtype == torch.int32
            and block_table.dim() == 2
            and block_table.shape[0] == nb,
            OP,
            "block_table",
            f"int32 [B={nb}, max_blocks]",
            None if block_table is None else f"{block_table.dtype} {list(block_table.shape)}",
        )
        need(all(s >= 0 for s in lens_k), OP, "actual_seq_lengths_key", "per-request lengths >= 0", lens_k)
        need(
            all(-(-s // bs) <= block_table.shape[1] for s in lens_k),
            OP,
            "block_table",
            "enough blocks for actual_seq_lengths_key",
            lens_k,
        )
        flat = key.reshape(-1, d)
        table = block_table.to(torch.int64)

        def keys_of(b: int, n: int) -> torch.Tensor:
            pos = torch.arange(n)
            blocks = table[b, pos // bs]
            need(
                bool((blocks >= 0).all() and (blocks < key.shape[0]).all()) if n else True,
                OP,
                "block_table",
                f"block ids in [0, {key.shape[0]})",
                table[b].tolist(),
            )
            return flat[blocks * bs + pos % bs]
    else:
        need(
            key.dim() == 3 and key.shape[1] == 1 and key.shape[2] == d,
            OP,
            "key",
            f"TND [T2, 1, {d}]",
            list(key.shape),
        )
        k_seg = cumulative_bounds(OP, "actual_seq_lengths_key", lens_k, key.shape[0])
        need(block_table is None, OP, "block_table", "None with a TND key", "a tensor")

        def keys_of(b: int, n: int) -> torch.Tensor:
            return key[k_seg[b][0] : k_seg[b][0] + n, 0]

        lens_k = [e - s for s, e in k_seg]

    indices = torch.full((t1, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((t1, 1, sparse_count), float("-inf")) if return_value else torch.empty(0)
    for b, (q0, q1) in enumerate(q_seg):
        l_q, l_kv = q1 - q0, lens_k[b]
        if l_q == 0 or l_kv == 0:
            continue
        k = keys_of(b, l_kv).float()  # [L_kv, D]
        dots = torch.einsum("thd,sd->ths", query[q0:q1].float(), k)  # [L_q, N1, L_kv]
        score = (torch.relu(dots) * weights[q0:q1].float()[:, :, None]).sum(1)  # [L_q, L_kv] fp32
        visible = torch.ones_like(score, dtype=torch.bool)
        if sparse_mode == 3:
            visible = torch.arange(l_kv)[None, :] <= (l_kv - l_q + torch.arange(l_q))[:, None]
        # ties: higher position first (flip, then a stable sort); masked keys are never emitted
        flipped = score.masked_fill(~visible, float("-inf")).flip(-1)
        order = torch.sort(flipped, dim=-1, descending=True, stable=True).indices[:, :sparse_count]
        pos = l_kv - 1 - order
        keep = visible.gather(1, pos)
        n = pos.shape[1]
        indices[q0:q1, 0, :n] = torch.where(keep, pos, -1).to(torch.int32)
        if return_value:
            values[q0:q1, 0, :n] = torch.where(keep, score.gather(1, pos), float("-inf"))
    return indices, values
