"""ascend backend: indexer_topk (SPEC 2.2) -> torch_npu.npu_lightning_indexer, re-ranked to SPEC 2.3.

Operator call (as vllm-ascend makes it): query TND `[T, N1, 128]` with `actual_seq_lengths_query` =
cu_seqlens_q[1:] (cumulative); key PA_BSND `[blocks, block_size, 1, 128]` with `block_table` and
`actual_seq_lengths_key` = seqlens_k (per request), or, for a ragged cache, TND `[rows, 1, 128]` with
cumulative key lengths; `sparse_mode=3` (right-down causal, the contract's rule); heads zero-padded
(zero query, zero weight) up to a head count the SoC accepts.

The tie rule. The operator documents no order among equal scores, so the adapter guarantees SPEC 2.3
itself: it asks for K' > topk candidates, recomputes each candidate's score in fp32, orders the
candidates by position and lets kernels_ascend.topk pick `topk` by (score desc, position asc). That is
exact whenever the candidates provably contain the rule's top-k: the row had <= K' causal keys, or its
weakest candidate scores below the k-th best by more than TIE_TOL (so no key outside could tie or beat
it, allowing TIE_TOL for the operator's own rounding). Rows that fail the test (a tie group running
past K') are recomputed exactly by the triton-ascend kernels (indexer_logits + topk), counted as route
"tie fallback". Hence tie_rule="lower_index" for the whole op.

Inputs the operator cannot take (fp32, D_I != 128, too many heads, odd block sizes, topk > 8192) go to
the same kernels, one block of ROW_BLOCK queries at a time, so memory stays O(ROW_BLOCK * S).

In the layout-invariant mode (SPEC 12) the operator does not run (it has no exact mode): per block of
ROW_BLOCK queries, the logits are weighted_sum(weights, relu(exact(q, K^T))) with the exact product on the
"ascend" engine (kernels_ascend.invariant_gemm) and the fixed tree over heads, as the reference's in the
mode, then kernels_ascend.topk selects by the rule (comparisons only: lower index on ties).
Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._provider import (
    BATCH_INVARIANT,
    BLOCK_MULTIPLE,
    MAX_BLOCK,
    MAX_SPARSE_COUNT,
    SPARSE_COUNTS,
    OpsProvider,
)
from backends.ascend.indexer_logits import ROW_BLOCK, kernel_logits
from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant
from backends.layout import SeqLayout

OP = "npu_lightning_indexer"
#: relative score gap (of the row's largest |score|) the closure test demands at the candidate boundary
TIE_TOL = 1e-4
#: queries per block when recomputing candidate scores
SCORE_BLOCK = 64
#: keys per exact product in the mode: bounds its [ROW_BLOCK * H_I, chunk] level sums
KEY_CHUNK = 2048
#: the route past the operator's limits: another cost class
FALLBACK = (
    "triton-ascend indexer_logits over the whole [rows, S] logits (ROW_BLOCK rows at a time), selected by "
    "kernels_ascend.topk: O(S + topk^2) per query row (a threshold search of 19 to 35 passes over S, "
    "then rank counting of the topk kept; Ascend has no tl.sort for int32 keys) instead of the "
    "operator's fused O(S)"
)
HEADS_REASON = (
    "npu_lightning_indexer takes <= 64 heads (A2/A3; 950: 8..64), and the kernel route holds all heads of "
    "a token in one tile"
)


def candidate_count(topk: int) -> int:
    """K' >= topk + a margin, rounded up to a sparse_count the operator accepts."""
    want = min(topk + max(16, topk // 8), MAX_SPARSE_COUNT)
    return min(c for c in SPARSE_COUNTS if c >= want)


def operator_reasons(provider: OpsProvider, q: torch.Tensor, k_cache: torch.Tensor, topk: int) -> list[str]:
    """Why npu_lightning_indexer cannot serve these inputs ([] if it can)."""
    why = []
    if q.dtype not in (torch.bfloat16, torch.float16):
        why.append(f"q dtype {q.dtype} (the operator takes bf16/fp16)")
    if q.shape[2] != 128:
        why.append(f"D_I={q.shape[2]} (the operator needs 128)")
    if provider.soc.pad_heads(provider.soc.indexer_heads, q.shape[1]) is None:
        why.append(f"{q.shape[1]} heads (more than {provider.soc.name} allows)")
    if k_cache.dim() == 3 and (k_cache.shape[1] % BLOCK_MULTIPLE or k_cache.shape[1] > MAX_BLOCK):
        why.append(f"block_size {k_cache.shape[1]} (a multiple of 16, <= 1024)")
    if topk > MAX_SPARSE_COUNT:
        why.append(f"topk {topk} > {MAX_SPARSE_COUNT}")
    return why


def call_operator(
    provider: OpsProvider, q, k_cache, weights, layout: SeqLayout, sparse_count: int
) -> torch.Tensor:
    """npu_lightning_indexer with the contract's inputs converted; returns int32 [T, sparse_count]."""
    heads = provider.soc.pad_heads(provider.soc.indexer_heads, q.shape[1])
    wdt = torch.float32 if provider.soc.weights_fp32 else q.dtype
    kw = dict(
        actual_seq_lengths_query=ad.query_lengths_tnd(layout),
        layout_query="TND",
        sparse_count=sparse_count,
        sparse_mode=3,
    )
    if layout.kind == "paged":
        key = k_cache.contiguous().unsqueeze(2)  # PA_BSND [nb, bs, 1, D]
        kw |= dict(
            actual_seq_lengths_key=ad.key_lengths_pa(layout),
            block_table=layout.block_table,
            layout_key="PA_BSND",
        )
    else:
        keys, cum = ad.compact_keys(layout, k_cache)
        key = keys.contiguous().unsqueeze(1)  # TND [rows, 1, D]
        kw |= dict(actual_seq_lengths_key=cum, layout_key="TND")
    idx, _ = provider.call(OP, ad.pad_heads(q, heads), key, ad.pad_heads(weights.to(wdt), heads), **kw)
    return idx[:, 0, :]


def candidate_scores(q, k_cache, weights, layout: SeqLayout, cand: torch.Tensor) -> torch.Tensor:
    """fp32 indexer scores of candidate positions cand [T, K'] (-inf where cand < 0), SCORE_BLOCK
    queries at a time so the gathered keys stay O(SCORE_BLOCK * K' * D_I)."""
    t_req = ad.token_request(layout)
    rows, start = ad.physical_rows(layout, k_cache)
    flat_cache = k_cache.reshape(-1, k_cache.shape[-1])
    valid = cand >= 0
    if rows.numel() == 0:
        return torch.full(cand.shape, float("-inf"), device=q.device)
    pos = (start[t_req][:, None] + cand.clamp(min=0).to(torch.int64)).clamp(max=max(rows.shape[0] - 1, 0))
    out = torch.empty(cand.shape, dtype=torch.float32, device=q.device)
    for a in range(0, cand.shape[0], SCORE_BLOCK):
        z = slice(a, a + SCORE_BLOCK)
        keys = flat_cache[rows[pos[z]]].float()  # [tq, K', D_I]
        dots = torch.einsum("thd,tjd->thj", q[z].float(), keys)  # [tq, H, K']
        # the head sum as a contraction (as the reference scores), not a .sum(): the same fp32 order
        out[z] = torch.einsum("thj,th->tj", torch.relu(dots), weights[z].float())
    return out.masked_fill(~valid, float("-inf"))


def rerank(cand: torch.Tensor, score: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order candidates by the rule. Returns (indices int32 [T, topk], resolved bool [T])."""
    from kernels_ascend.topk import topk as kernel_topk

    key = torch.where(cand >= 0, cand.to(torch.int64), torch.iinfo(torch.int64).max)
    order = torch.sort(key, dim=1).indices  # position asc, -1 last
    cand, score = cand.gather(1, order), score.gather(1, order)
    n_valid = (cand >= 0).sum(1)
    vals, cols = kernel_topk(score, topk, n_valid)
    out = torch.where(cols >= 0, cand.gather(1, cols.clamp(min=0).to(torch.int64)), -1).to(torch.int32)
    full = n_valid < cand.shape[1]  # every causal key is a candidate
    kth = vals[:, min(topk, cand.shape[1]) - 1]
    weakest = score.masked_fill(cand < 0, float("inf")).min(1).values
    scale = score.masked_fill(cand < 0, 0).abs().amax(1)
    closed = weakest < kth - TIE_TOL * scale
    return out, full | closed


def kernel_topk_rows(q, k_cache, weights, layout: SeqLayout, topk: int, rows: torch.Tensor) -> torch.Tensor:
    """Exact path for query rows `rows` (int64): kernel logits then kernel top-k, ROW_BLOCK rows at a time."""
    from kernels_ascend.topk import topk as kernel_topk

    out = torch.full((rows.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for a in range(0, rows.shape[0], ROW_BLOCK):
        sel = rows[a : a + ROW_BLOCK]
        logits, visible = kernel_logits(q, k_cache, weights, layout, sel)
        out[a : a + ROW_BLOCK] = kernel_topk(logits, topk, visible)[1]
    return out


def exact_logits(
    q, k_cache, weights, layout: SeqLayout, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 12's logits of `tokens` (int64 [n]): ([n, max seqlen_k] fp32, -inf past the causal keys;
    visible int32 [n]), sum_h w[t, h] relu(exact(q[t, h], K_j)) by `weighted_sum`'s fixed tree."""
    rows, _ = ad.physical_rows(layout, k_cache)  # every request's keys, request by request
    t_req = ad.token_request(layout)[tokens]
    visible = ad.causal_visible(layout)[tokens]
    flat = k_cache.reshape(-1, k_cache.shape[-1])
    n, h, d = tokens.shape[0], q.shape[1], q.shape[2]
    out = torch.full((n, layout.seqlen_k_max()), float("-inf"), device=q.device)
    start = 0
    for b, (_, _, s) in enumerate(layout.request_bounds()):
        mine = (t_req == b).nonzero()[:, 0]
        tok = tokens[mine]
        for c0 in range(0, s if mine.numel() else 0, KEY_CHUNK):  # each key's column is its own: any chunk
            c1 = min(c0 + KEY_CHUNK, s)
            keys = flat[rows[start + c0 : start + c1]].float()  # [chunk, D_I]
            dots = invariant.exact_matmul(q[tok].float().reshape(-1, d), keys.T, engine="ascend").relu_()
            scores = invariant.weighted_sum(weights[tok].float(), dots.view(-1, h, c1 - c0))  # [n_b, chunk]
            causal = torch.arange(c0, c1, device=q.device)[None, :] < visible[mine, None]
            out[mine, c0:c1] = scores.masked_fill(~causal, float("-inf"))
        start += s
    return out, visible


def impl(provider: OpsProvider) -> OpImpl:
    def indexer_topk(q, k_cache, weights, layout, topk):
        t = q.shape[0]
        if invariant.active():
            from kernels_ascend.topk import topk as kernel_topk

            provider.record(
                "indexer_topk", "layout-invariant: " + provider.kernel_label("invariant_gemm + topk")
            )
            out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
            for a in range(0, t, ROW_BLOCK):
                logits, visible = exact_logits(
                    q, k_cache, weights, layout, torch.arange(a, min(a + ROW_BLOCK, t), device=q.device)
                )
                out[a : a + ROW_BLOCK] = kernel_topk(logits, topk, visible)[1]
            return out
        if operator_reasons(provider, q, k_cache, topk):
            provider.record("indexer_topk", provider.kernel_label("indexer_logits + topk"))
            return kernel_topk_rows(q, k_cache, weights, layout, topk, torch.arange(t))
        cand = call_operator(provider, q, k_cache, weights, layout, candidate_count(topk))
        out, resolved = rerank(cand, candidate_scores(q, k_cache, weights, layout, cand), topk)
        provider.record("indexer_topk", provider.label(OP) + " + re-rank")
        todo = (~resolved).nonzero()[:, 0]
        if todo.numel():
            provider.record("indexer_topk", "tie fallback: " + provider.kernel_label("indexer_logits + topk"))
            out[todo] = kernel_topk_rows(q, k_cache, weights, layout, topk, todo)
        return out

    return OpImpl(
        indexer_topk,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            batch_invariant=BATCH_INVARIANT,
            tie_rule="lower_index",
            layout_invariant=True,  # the mode's route: exact logits, then the kernel's comparisons
            limits=(
                Limit("index_heads", max=64, reason=HEADS_REASON),
                Limit(
                    "topk",
                    max=MAX_SPARSE_COUNT,
                    reason="npu_lightning_indexer's sparse_count",
                    route=FALLBACK,
                ),
                # D_I < 128 takes the same route (a min=128 bound would repeat the at-128 case)
                Limit("index_head_dim", max=128, reason="the operator's D is 128", route=FALLBACK),
            ),
            notes={
                "operator": "bf16/fp16, D_I=128, block_size % 16 == 0 <= 1024, topk <= 8192; "
                f"otherwise (and per row for a tie group running past the K' candidates): {FALLBACK}",
            },
        ),
    )
