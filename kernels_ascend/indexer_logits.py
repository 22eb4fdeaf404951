"""Lightning-indexer logits for Ascend (SPEC 2.1): the full [T, S] scores the fused
npu_lightning_indexer never returns for a paged cache (it returns top-k indices only).

One program per AI core (the kernel uses tl.dot); each loops over query tokens pid, pid + P, ... and,
per token, over BLOCK_S key tiles up to the token's causal count. Keys are gathered by physical row
(`key_rows[key_start[t] + j]`, built by the adapter from the SeqLayout), so ragged and paged caches
share the kernel. Per tile: q [H, D] . K^T [D, BLOCK_S] on the cube in fp32 (inputs widened, since
the interpreter's bf16 dot is wrong), ReLU, times the head weights, summed over heads.
Tiles: BLOCK_S=64 keys x D=128 fp32 = 32 KB plus q [H<=64, 128] fp32 <= 32 KB: inside the UB.
Numerics: fp32 accumulation like the reference, but the cube's dot order differs: results agree to
fp32 reduction tolerance, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_S = 64


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    rows_ptr,
    kstart_ptr,
    visible_ptr,
    out_ptr,
    T,
    H,
    D,
    S_out,
    tok_per_prog,
    NPROG: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    oh = tl.arange(0, HP)
    od = tl.arange(0, DP)
    for it in range(0, tok_per_prog):
        t = pid + it * NPROG
        if t < T:
            q = tl.load(
                q_ptr + t * H * D + oh[:, None] * D + od[None, :],
                mask=(oh[:, None] < H) & (od[None, :] < D),
                other=0.0,
            ).to(tl.float32)  # [HP, DP]
            w = tl.load(w_ptr + t * H + oh, mask=oh < H, other=0.0)  # [HP]
            k0 = tl.load(kstart_ptr + t)
            n = tl.load(visible_ptr + t)
            for j0 in range(0, n, BLOCK):
                oj = j0 + tl.arange(0, BLOCK)
                mj = oj < n
                rows = tl.load(rows_ptr + k0 + oj, mask=mj, other=0).to(tl.int64)
                k = tl.load(
                    cache_ptr + rows[:, None] * D + od[None, :],
                    mask=mj[:, None] & (od[None, :] < D),
                    other=0.0,
                ).to(tl.float32)  # [BLOCK, DP]
                dots = tl.dot(q, tl.trans(k))  # [HP, BLOCK]
                score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)  # [BLOCK]
                tl.store(out_ptr + t * S_out + oj, score, mask=mj)


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache_rows: torch.Tensor,
    key_rows: torch.Tensor,
    key_start: torch.Tensor,
    visible: torch.Tensor,
    s_out: int,
) -> torch.Tensor:
    """q: [T, H_I, D_I] float; weights: [T, H_I] fp32; cache_rows: [rows, D_I] (the cache flattened to rows);
    key_rows: int32 [n] physical rows; token t's causal keys 0..visible[t]-1 are rows
    key_rows[key_start[t] + j]. Returns [T, s_out] fp32, -inf past each token's causal keys.
    Semantics: backends/reference/indexer_logits.py (SPEC 2.1)"""
    t, h, d = q.shape
    out = torch.full((t, s_out), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or s_out == 0:
        return out
    nprog = min(num_cores("aicore"), t)
    _indexer_logits_kernel[(nprog,)](
        q.contiguous(),
        weights.contiguous(),
        cache_rows.contiguous(),
        key_rows,
        key_start,
        visible,
        out,
        t,
        h,
        d,
        s_out,
        triton.cdiv(t, nprog),
        NPROG=nprog,
        HP=max(16, triton.next_power_of_2(h)),
        DP=max(16, triton.next_power_of_2(d)),
        BLOCK=BLOCK_S,
    )
    count_launch("indexer_logits")
    return out
