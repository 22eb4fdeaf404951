"""The `cpu` backend: fast plain-torch implementations of every op for the CPU (issue 14).

Exact where the contract is exact (top-k orders, integer accumulators, dynamic quant: bitwise the
reference's), within the contract's tolerances elsewhere. The FP8 ops (SPEC 7) too: e4m3 is decoded in
torch (`_fp8.py`), block dots are exact in fp64, so the quantizers, the block / grouped GEMMs and the FP8
indexer top-k are the reference's bits; FP8 indexer logits and attention are within tolerance. The
reference stays the oracle: no reference op runs here; only the indexers' block scores are the
reference's own score functions (the same call is the only way to its bits on every CPU). Which file serves
which op: backends/cpu/<op>.py
(capabilities next to the function).
"""

from __future__ import annotations

import platform

import torch

from backends.contract.table import load_ops
from backends.cpu._intmm import PATH as INT_GEMM
from backends.interface import Backend


class CpuBackend(Backend):
    name = "cpu"
    device = "cpu"
    ops = load_ops("backends.cpu")

    def available(self) -> tuple[bool, str]:
        return (
            True,
            f"plain torch on {platform.machine()}, {torch.get_num_threads()} threads, int GEMM {INT_GEMM}",
        )

    def environment(self) -> dict[str, str]:
        return {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "int_gemm": INT_GEMM,
            "threads": str(torch.get_num_threads()),
        }
