"""Exact integer GEMM: the fastest exact path this CPU has, chosen once at import.

`torch._int_mm` (int8 x int8 -> int32; oneDNN uses VNNI where the CPU has it) is exact and several
times faster than an fp64 GEMM of integer-valued tensors where VNNI exists; without it (or where the op
is missing) the fp64 GEMM is exact too (|acc| <= 127 * 128 * K < 2^53).
"""

from __future__ import annotations

import torch


def _probe() -> str:
    try:
        a = torch.arange(-64, 64, dtype=torch.int8).reshape(2, 64)
        got = torch._int_mm(a, a.T)
        if not torch.equal(got.to(torch.int64), (a.double() @ a.double().T).to(torch.int64)):
            return "fp64"
        return "int_mm" if _vnni() else "fp64"
    except (RuntimeError, AttributeError):
        return "fp64"


def _vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags
    except OSError:
        return False


PATH = _probe()
#: torch 2.13's CPU `_int_mm` returns wrong sums for K == 1 (M > 1); tiny K is cheap in fp64 anyway.
MIN_K = 8


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] x b int8 [N, K]^T -> exact integer accumulators [M, N] (int32 or float64)."""
    if PATH == "int_mm" and a.shape[0] and a.shape[1] >= MIN_K and b.shape[0]:
        return torch._int_mm(a.contiguous(), b.T)
    return a.double() @ b.double().T
