"""Per-row dynamic int8 quantization for Ascend (SPEC 2.5), for the inputs npu_dynamic_quant does not
take (float32 rows: the operator accepts fp16/bf16 only).

One program per vector core, rows pid, pid + P, ...; two passes over the row in BLOCK_K tiles
(4 KB fp32): amax, then x / scale rounded half-to-even and clamped to [-127, 127].
Rounding uses the fp32 "magic number" (y + 1.5 * 2^23) - 1.5 * 2^23, exact round-half-even for
|y| < 2^22 (here |y| <= 127); the division is the reference's fp32 x / scale, so results are bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ascend._launch import count_launch, num_cores

BLOCK_K = 1024
_MAGIC = 12582912.0  # 1.5 * 2**23


@triton.jit
def _dynamic_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, rows_per_prog, NPROG: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for it in range(0, rows_per_prog):
        row = pid + it * NPROG
        if row < M:
            amax = 0.0
            for k0 in range(0, K, BLOCK):
                ok = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * K + ok, mask=ok < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            scale = tl.maximum(amax, 1e-10) / 127.0
            tl.store(s_ptr + row, scale)
            for k0 in range(0, K, BLOCK):
                ok = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * K + ok, mask=ok < K, other=0.0).to(tl.float32)
                y = x / scale
                r = (y + 12582912.0) - 12582912.0
                r = tl.minimum(tl.maximum(r, -127.0), 127.0)
                tl.store(q_ptr + row * K + ok, r.to(tl.int8), mask=ok < K)


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float. Returns (x_q int8 [M, K], scale fp32 [M]).
    Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)"""
    m, k = x.shape
    x_q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scale
    nprog = min(num_cores("vectorcore"), m)
    _dynamic_quant_kernel[(nprog,)](
        x.contiguous(), x_q, scale, m, k, triton.cdiv(m, nprog), NPROG=nprog, BLOCK=BLOCK_K
    )
    count_launch("dynamic_quant_int8")
    return x_q, scale
