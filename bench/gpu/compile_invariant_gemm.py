"""Compile the layout-invariant mode's digit-product kernel (kernels_cuda/invariant_gemm.py) for sm_90
(H100 / H200) on a machine with no GPU, at each tile the launcher picks: int8 `tl.dot` with int32
accumulation must lower to the s8 tensor-core instructions. Exit status 1 with the compiler's message if a
tile fails. Run without TRITON_INTERPRET (the kernel must be decorated for the compiler).

    python bench/gpu/compile_invariant_gemm.py
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels_cuda import invariant_gemm  # noqa: E402

SIGNATURE = {
    "a_ptr": "*i8",
    "b_ptr": "*i8",
    "out_ptr": "*i64",
    **{name: "i32" for name in ("M", "N", "K", "stride_ad", "stride_ab", "stride_am", "stride_ak")},
    **{name: "i32" for name in ("stride_bb", "stride_bn", "stride_bk", "stride_ob", "stride_om")},
}
CONSTEXPRS = ("SLICES", "SLICE_BITS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")


def compile_tiles() -> int:
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    for m in (1, 64, 4096):  # one M of each tile `_gpu_tile` picks
        bm, bn, bk, warps, stages = invariant_gemm._gpu_tile(m)
        constexprs = dict(SLICES=4, SLICE_BITS=7, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
        signature = {**SIGNATURE, **{name: "constexpr" for name in CONSTEXPRS}}
        t0 = time.perf_counter()
        try:
            src = ASTSource(invariant_gemm._digit_product_kernel, signature, constexprs=constexprs)
            kernel = triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=stages))
            assert "cubin" in kernel.asm, "no cubin produced"
            mma = sum(line.count("mma") for line in kernel.asm["ptx"].splitlines() if ".s8" in line)
            status = f"ok, {kernel.metadata.shared} B shared, {mma} s8 mma instructions in the PTX"
        except Exception as exc:  # every compiler error is a finding: report it and go on
            failures += 1
            status = f"FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        seconds = time.perf_counter() - t0
        print(f"tile {bm}x{bn}x{bk} ({warps} warps, {stages} stages): {status} ({seconds:.1f} s)")
    return failures


if __name__ == "__main__":
    sys.exit(1 if compile_tiles() else 0)
