"""EMULATION of `torch_npu.npu_sparse_flash_attention` (torch_npu 2.14; op-plugin docs).

Documented semantics with `attention_mode=2` (MLA absorbed; the only mode supported): per query token
t and head n, over the keys selected by `sparse_indices[t, 0, :]` (logical positions in the request;
entry i selects positions [i*sparse_block_size, (i+1)*sparse_block_size)),

    s_j = scale_value * (query[t,n] . key_j + query_rope[t,n] . key_rope_j)      fp32
    softmax_max[t,n] = max_j s_j,  softmax_sum[t,n] = sum_j exp(s_j - softmax_max)
    attention_out[t,n] = sum_j exp(s_j - softmax_max) / softmax_sum * value_j     (value is key, D = 512)

`sparse_indices` must hold its valid entries first and -1 packed at the end: this emulation stops at
the first -1 (entries after it are not read), and reads whatever row an out-of-range position names,
as the kernel would (undefined). `sparse_mode=3` additionally masks keys past L_kv - L_q + i.
Outputs: attention_out like query; softmax_max/softmax_sum fp32 `[N2=1, T1, N1]` when
`return_softmax_lse=True` (documented for non-PA layouts only), else empty tensors. A row with no
selected key is undefined in the docs; emulated as out = 0, softmax_max = -3.4e38, softmax_sum = 0.

Limits enforced: bf16/fp16 query/key/value of one dtype; D = 512, Dr = 64; N2 = 1; N1 per SoC
(A2/A3: power of two <= 128); block_size a multiple of 16, <= 1024; sparse_block_size a power of
two in [1, 128] dividing block_size; `sparse_indices` int32 `[T1, 1, K]`; query, key, value,
sparse_indices, query_rope and key_rope contiguous ("不支持非连续" in the operator's parameter table,
ops-transformer attention/sparse_flash_attention/README.md: the kernel addresses them densely).

PA_BSND (paged) kv: key `[blocks, block_size, 1, 512]`, key_rope `[blocks, block_size, 1, 64]`,
`block_table` int32 `[B, >= ceil(max_b S2_b / block_size)]`, `actual_seq_lengths_kv` int32 `[B]`
per-request lengths (not cumulative), each in [0, block_table columns * block_size]; position p of
request b lives in row p % block_size of block block_table[b, p // block_size]; no softmax lse.
TND kv: key `[T2, 1, 512]` with cumulative `actual_seq_lengths_kv`.
"""

from __future__ import annotations

import torch

from backends.ascend._soc import SOCS
from backends.ascend.emulation._checks import (
    NotEmulated,
    cumulative_bounds,
    need,
    need_dtype,
    need_int32_vector,
    need_pa_bsnd,
)

OP = "npu_sparse_flash_attention"
_INT64_MAX = 2**63 - 1
_FP32_LOWEST = torch.finfo(torch.float32).min


def npu_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    *,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=_INT64_MAX,
    next_tokens=_INT64_MAX,
    attention_mode=0,
    return_softmax_lse=False,
    sinks=None,
    _soc="A3",
):
    soc = SOCS[_soc]
    need(
        attention_mode == 2, OP, "attention_mode", "2 (MLA absorbed; the only supported mode)", attention_mode
    )
    if layout_query != "TND" or layout_kv not in ("TND", "PA_BSND") or sinks is not None:
        raise NotEmulated(
            f"{OP}: layout_query={layout_query!r}, layout_kv={layout_kv!r}, sinks "
            "(emulated: TND query, TND or PA_BSND kv, no sinks)"
        )
    for name, t in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("sparse_indices", sparse_indices),
        ("query_rope", query_rope),
        ("key_rope", key_rope),
    ):
        need(
            not isinstance(t, torch.Tensor) or t.is_contiguous(),
            OP,
            name,
            "a contiguous tensor (the operator takes no non-contiguous input)",
            f"strides {None if not isinstance(t, torch.Tensor) else t.stride()}",
        )
    need_dtype(OP, "query", query, (torch.bfloat16, torch.float16))
    need(query.dim() == 3 and query.shape[2] == 512, OP, "query", "TND [T1, N1, 512]", list(query.shape))
    t1, n1, _ = query.shape
    need(n1 in soc.sfa_heads, OP, "query", f"N1 in {soc.name}'s supported head counts", n1)
    need(
        isinstance(query_rope, torch.Tensor)
        and query_rope.dtype == query.dtype
        and tuple(query_rope.shape) == (t1, n1, 64),
        OP,
        "query_rope",
        f"{query.dtype} [T1, N1, 64]",
        None if query_rope is None else f"{query_rope.dtype} {list(query_rope.shape)}",
    )
    need(
        value is key or (value is not None and value.data_ptr() == key.data_ptr()),
        OP,
        "value",
        "the key tensor (attention_mode=2: key and value share the latent)",
        "another tensor",
    )
    need(key.dtype == query.dtype, OP, "key", f"dtype {query.dtype}", key.dtype)
    need(
        isinstance(key_rope, torch.Tensor) and key_rope.dtype == query.dtype,
        OP,
        "key_rope",
        f"a {query.dtype} tensor",
        None if key_rope is None else key_rope.dtype,
    )
    need(sparse_mode in (0, 3), OP, "sparse_mode", "0 or 3", sparse_mode)
    need(
        pre_tokens == _INT64_MAX and next_tokens == _INT64_MAX,
        OP,
        "pre_tokens/next_tokens",
        "defaults",
        (pre_tokens, next_tokens),
    )
    sbs = sparse_block_size
    need(sbs in (1, 2, 4, 8, 16, 32, 64, 128), OP, "sparse_block_size", "a power of two in [1, 128]", sbs)
    need(
        not (return_softmax_lse and layout_kv == "PA_BSND"),
        OP,
        "return_softmax_lse",
        "False with a PA_BSND kv layout (training / non-PA only)",
        True,
    )
    need(
        isinstance(sparse_indices, torch.Tensor)
        and sparse_indices.dtype == torch.int32
        and sparse_indices.dim() == 3
        and sparse_indices.shape[:2] == (t1, 1),
        OP,
        "sparse_indices",
        f"int32 [T1={t1}, 1, K]",
        None if sparse_indices is None else f"{sparse_indices.dtype} {list(sparse_indices.shape)}",
    )

    cu_q = need_int32_vector(OP, "actual_seq_lengths_query", actual_seq_lengths_query).tolist()
    nb = len(cu_q)
    q_seg = cumulative_bounds(OP, "actual_seq_lengths_query", cu_q, t1)
    kv_arg = need_int32_vector(OP, "actual_seq_lengths_kv", actual_seq_lengths_kv, nb).tolist()
    if layout_kv == "PA_BSND":
        bs = need_pa_bsnd(OP, key, 512)
        need(bs % sbs == 0, OP, "sparse_block_size", f"a divisor of block_size {bs}", sbs)
        need(
            tuple(key_rope.shape) == (key.shape[0], bs, 1, 64),
            OP,
            "key_rope",
            "[blocks, block_size, 1, 64]",
            list(key_rope.shape),
        )
        need(
            isinstance(block_table, torch.Tensor)
            and block_table.dtype == torch.int32
            and block_table.dim() == 2
            and block_table.shape[0] == nb,
            OP,
            "block_table",
            f"int32 [B={nb}, max_blocks]",
            None if block_table is None else list(block_table.shape),
        )
        cap = block_table.shape[1] * bs
        need(
            all(0 <= s <= cap for s in kv_arg),
            OP,
            "actual_seq_lengths_kv",
            f"per-request lengths in [0, {cap}] (PA_BSND is not cumulative; block_table columns "
            f">= ceil(S2max / block_size))",
            kv_arg,
        )
        used = [block_table[b, : -(-s // bs)] for b, s in enumerate(kv_arg)]
        need(
            all(u.numel() == 0 or (int(u.min()) >= 0 and int(u.max()) < key.shape[0]) for u in used),
            OP,
            "block_table",
            f"block ids in [0, {key.shape[0]}) for every used block",
            [u.tolist() for u in used][:4],
        )
        lens_kv, flat_k, flat_r = kv_arg, key.reshape(-1, 512), key_rope.reshape(-1, 64)

        def rows_of(b: int, pos: torch.Tensor) -> torch.Tensor:
            blk = pos // bs
            need(
                bool((blk < block_table.shape[1]).all()),
                OP,
                "sparse_indices",
                "positions inside the block table",
                int(pos.max()),
            )
            return block_table[b].to(torch.int64)[blk] * bs + pos % bs
    else:
        need(key.dim() == 3 and key.shape[1:] == (1, 512), OP, "key", "TND [T2, 1, 512]", list(key.shape))
        need(
            tuple(key_rope.shape) == (key.shape[0], 1, 64),
            OP,
            "key_rope",
            "TND [T2, 1, 64]",
            list(key_rope.shape),
        )
        k_seg = cumulative_bounds(OP, "actual_seq_lengths_kv", kv_arg, key.shape[0])
        lens_kv, flat_k, flat_r = [e - s for s, e in k_seg], key[:, 0], key_rope[:, 0]

        def rows_of(b: int, pos: torch.Tensor) -> torch.Tensor:
            return pos + k_seg[b][0]

    out = torch.zeros(t1, n1, 512, dtype=query.dtype)
    smax = torch.full((t1, n1), _FP32_LOWEST)
    ssum = torch.zeros(t1, n1)
    idx_all = sparse_indices[:, 0].to(torch.int64)
    for b, (q0, q1) in enumerate(q_seg):
        l_q = q1 - q0
        for i, t in enumerate(range(q0, q1)):
            row = idx_all[t]
            stop = int((row < 0).nonzero()[0, 0]) if bool((row < 0).any()) else row.shape[0]
            blocks = row[:stop]  # the valid prefix only
            pos = (blocks[:, None] * sbs + torch.arange(sbs)[None, :]).reshape(-1)
            if sparse_mode == 3:
                pos = pos[pos <= lens_kv[b] - l_q + i]
            if pos.numel() == 0:
                continue
            rows = rows_of(b, pos)
            need(
                bool((rows >= 0).all() and (rows < flat_k.shape[0]).all()),
                OP,
                "sparse_indices",
                "positions that address the cache",
                pos.tolist()[:8],
            )
            k, kr = flat_k[rows].float(), flat_r[rows].float()  # [n, 512], [n, 64]
            s = (query[t].float() @ k.T + query_rope[t].float() @ kr.T) * scale_value  # [N1, n]
            m = s.max(dim=-1).values
            e = torch.exp(s - m[:, None])
            smax[t], ssum[t] = m, e.sum(-1)
            out[t] = ((e / ssum[t][:, None]) @ k).to(query.dtype)
    if not return_softmax_lse:
        return out, torch.empty(0), torch.empty(0)
    return out, smax[None], ssum[None]
