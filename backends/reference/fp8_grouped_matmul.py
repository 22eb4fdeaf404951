"""FP8 block-scaled MoE GEMM over expert-sorted rows (SPEC 7.3; DeepGEMM
`m_grouped_fp8_gemm_nt_contiguous`, vLLM/SGLang fused MoE with `block_shape=[128, 128]`).

    out[group_offsets[e] : group_offsets[e+1]] = fp8_block_matmul(x_q[rows], x_scale[rows],
                                                                  w_q[e], w_scale_inv[e])

x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3 [E, N, K], w_scale_inv fp32
[E, ceil(N/128), ceil(K/128)]. Each row depends only on itself and its expert (empty experts legal);
DeepGEMM's contiguous layout additionally pads each segment to its M block, which the caller drops.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.ops import FLOATS
from backends.reference.fp8_block_matmul import BLOCK, block_dots, promote


@reference_op("fp8_grouped_matmul")
def fp8_grouped_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    group_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    m, n = x_q.shape[0], w_q.shape[1]  # x_q: [M, K], w_q: [E, N, K]
    out = torch.zeros(m, n, dtype=out_dtype)
    offs = group_offsets.tolist()
    for e in range(w_q.shape[0]):
        if offs[e] == offs[e + 1]:
            continue
        r = slice(offs[e], offs[e + 1])
        w_rows = w_scale_inv[e].float().repeat_interleave(BLOCK, dim=0)[:n]
        out[r] = promote(block_dots(x_q[r], w_q[e]), x_scale[r].float(), w_rows).to(out_dtype)
    return out


IMPL = OpImpl(fp8_grouped_matmul, OpCaps(FLOATS))
