"""Linear + cross-entropy pieces for Ascend (SPEC 2.9); no fused torch_npu operator covers it.

Driven chunk by chunk by the backend so the [N, V] fp32 logits never exist at once:
- `kernels_ascend._matmul.matmul` (strided fp32 tiles) for h @ W^T, dL @ W and dL^T @ h;
- `_row_softmax_kernel`: per row of a logits chunk (one program per vector core, rows pid, pid + P, ...):
  a BLOCK_V pass for the running max / sum (logsumexp) and the target logit; with GRAD, a second pass
  rewrites the row in place as (softmax - onehot(target)) * row_scale, the logits' gradient.
Tiles: 1 KB row tiles, inside the UB.
Numerics: fp32 throughout like the reference; reduction orders differ (fp32 tolerance, not bitwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores
from kernels_ascend._matmul import matmul

BLOCK_V = 256


@triton.jit
def _row_softmax_kernel(
    x_ptr,
    tgt_ptr,
    scale_ptr,
    lse_ptr,
    tl_ptr,
    R,
    V,
    rows_per_prog,
    GRAD: tl.constexpr,
    NPROG: tl.constexpr,
    BV: tl.constexpr,
):
    pid = tl.program_id(0)
    for it in range(0, rows_per_prog):
        r = pid + it * NPROG
        if r < R:
            tgt = tl.load(tgt_ptr + r)
            m = float("-inf")
            s = 0.0
            t_logit = 0.0
            for v0 in range(0, V, BV):
                ov = v0 + tl.arange(0, BV)
                x = tl.load(x_ptr + r * V + ov, mask=ov < V, other=float("-inf"))
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
                t_logit += tl.sum(tl.where(ov == tgt, x, 0.0), axis=0)
            lse = m + tl.log(s)
            tl.store(lse_ptr + r, lse)
            tl.store(tl_ptr + r, t_logit)
            if GRAD:
                g = tl.load(scale_ptr + r)
                for v0 in range(0, V, BV):
                    ov = v0 + tl.arange(0, BV)
                    x = tl.load(x_ptr + r * V + ov, mask=ov < V, other=0.0)
                    d = (tl.exp(x - lse) - tl.where(ov == tgt, 1.0, 0.0)) * g
                    tl.store(x_ptr + r * V + ov, d, mask=ov < V)


def row_softmax(
    logits: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] fp32 contiguous; targets int [R] (any value; out-of-range picks nothing).
    Returns (lse [R], target logit [R]); with row_scale [R], also rewrites logits in place into
    (softmax - onehot(target)) * row_scale."""
    r, v = logits.shape
    lse = torch.empty(r, dtype=torch.float32, device=logits.device)
    t_logit = torch.empty(r, dtype=torch.float32, device=logits.device)
    if r:
        nprog = min(num_cores("vectorcore"), r)
        scale = row_scale if row_scale is not None else lse
        _row_softmax_kernel[(nprog,)](
            logits,
            targets.to(torch.int32).contiguous(),
            scale,
            lse,
            t_logit,
            r,
            v,
            triton.cdiv(r, nprog),
            GRAD=row_scale is not None,
            NPROG=nprog,
            BV=BLOCK_V,
        )
        count_launch("linear_cross_entropy.row_softmax")
    return lse, t_logit


__all__ = ["matmul", "row_softmax"]
