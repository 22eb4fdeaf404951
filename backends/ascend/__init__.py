"""The `ascend` backend: torch_npu fused operators (Atlas A2/A3, Ascend 950) through plain-torch adapters,
and triton-ascend kernels (kernels_ascend/) where no operator exists or its limits do not fit.

Which file serves which op (backends/ascend/<op>.py: capabilities, reasons, adapter):

    indexer_logits        kernels_ascend.indexer_logits
    indexer_topk          npu_lightning_indexer + exact re-rank (ties: kernels)  tie_rule lower_index
    topk                  kernels_ascend.topk                                   tie_rule lower_index
    sparse_mla_attention  torch_npu.npu_sparse_flash_attention (GLM-5 shapes), kernels_ascend otherwise
    dynamic_quant_int8    torch_npu.npu_dynamic_quant (bf16/fp16), kernels_ascend (fp32)
    w8a8_matmul           torch_npu.npu_quant_matmul
    w4a8_matmul           torch_npu.npu_grouped_matmul (per-channel), kernels_ascend.w4a8_matmul (per-group)
    grouped_matmul        torch_npu.npu_grouped_matmul, kernels_ascend.w4a8_matmul (per-group W4A8)
    linear_cross_entropy  kernels_ascend.linear_cross_entropy (chunked, differentiable)
    silu_and_mul          torch_npu.npu_swiglu (backward: the contract's formula in torch)

The operators are reached through one `OpsProvider` (_provider.py): torch_npu on an NPU, or, only when
GLM5_ASCEND_EMULATE=1, CPU EMULATIONS written from the operators' documentation (emulation/), with the
kernels in triton-ascend's interpreter (TRITON_INTERPRET=1). Every report carries which one ran.

In the layout-invariant mode (SPEC 12) the fused operators have no exact mode: sparse_mla_attention,
indexer_topk, float grouped_matmul and silu_and_mul compose torch ops with the exact product on the
"ascend" engine (kernels_ascend.invariant_gemm: int8 digit products, int32 level sums), as each op's
file says.
"""

from __future__ import annotations

import importlib.util
import platform
from collections import Counter

import torch

from backends.ascend import _provider
from backends.ascend.sparse_mla_attention import CACHE_LAYOUT as sfa_cache_layout
from backends.contract.table import load_ops
from backends.interface import Backend

#: what serves each op, for reports (the route actually taken per call is in environment()["routes"])
PROVENANCE = {
    "indexer_logits": "triton-ascend kernel",
    "indexer_topk": "torch_npu npu_lightning_indexer + re-rank; triton-ascend kernels off-limits / on ties",
    "topk": "triton-ascend kernel",
    "sparse_mla_attention": "torch_npu npu_sparse_flash_attention (GLM-5 shapes); triton-ascend kernel",
    "dynamic_quant_int8": "torch_npu npu_dynamic_quant (bf16/fp16); triton-ascend kernel (fp32)",
    "w8a8_matmul": "torch_npu npu_quant_matmul; triton-ascend kernel outside its output table",
    "w4a8_matmul": "torch_npu npu_grouped_matmul (per-channel); triton-ascend kernel (per-group)",
    "grouped_matmul": "torch_npu npu_grouped_matmul; triton-ascend kernels per expert (fp32, per-group)",
    "linear_cross_entropy": "triton-ascend kernels (chunked)",
    "silu_and_mul": "torch_npu npu_swiglu",
}


def _triton_ascend() -> tuple[str | None, str]:
    """(version, why not) of triton-ascend: the `triton` package with an `ascend` backend."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton-ascend is not installed"
    import triton

    if importlib.util.find_spec("triton.backends.ascend") is None:
        return (
            None,
            f"the installed triton {triton.__version__} is not triton-ascend (no triton.backends.ascend)",
        )
    return triton.__version__, "ok"


class AscendBackend(Backend):
    name = "ascend"
    #: npu_sparse_flash_attention reads the latent cache as two PA_BSND pools (no per-call copy)
    mla_cache = sfa_cache_layout

    def __init__(self) -> None:
        super().__init__()
        self.resolution = _provider.resolve()
        self.provider = self.resolution.provider
        self.device = self.provider.device if self.provider else "npu"
        self.ops = load_ops("backends.ascend", self.provider) if self.provider else {}
        if self.provider is not None:  # the adapters count re-layouts of unprepared weights here
            self.relayouts = self.provider.relayouts

    def available(self) -> tuple[bool, str]:
        from kernels_ascend import interpreter_active

        if self.provider is None:
            return False, self.resolution.reason
        version, why = _triton_ascend()
        if version is None:
            return False, f"{why}; its kernels serve topk, indexer_logits and more"
        if self.provider.emulated:
            if not interpreter_active():
                return False, (
                    "emulation mode needs TRITON_INTERPRET=1 (set before import): there is no NPU to "
                    "run the triton-ascend kernels on"
                )
            return True, (
                f"{self.provider.detail}; triton-ascend {version} kernels in its interpreter "
                "(TRITON_INTERPRET=1)"
            )
        if interpreter_active():
            return False, "TRITON_INTERPRET=1 with a real NPU: unset it (the kernels would run on the host)"
        return True, f"{self.provider.detail}; triton-ascend {version}"

    def kernel_calls(self) -> Counter[str]:
        from kernels_ascend import LAUNCHES

        out = Counter(LAUNCHES)
        if self.provider is not None:
            out.update(self.provider.calls)
        return out

    def provenance(self) -> dict[str, str]:
        """op -> what serves it here, with the emulation / interpreter qualifiers."""
        if self.provider is None:
            return {op: "unavailable" for op in PROVENANCE}
        from kernels_ascend import interpreter_active

        npu = "torch_npu (emulated)" if self.provider.emulated else "torch_npu"
        tri = "triton-ascend (interpreted)" if interpreter_active() else "triton-ascend"
        return {op: p.replace("torch_npu", npu).replace("triton-ascend", tri) for op, p in PROVENANCE.items()}

    def environment(self) -> dict[str, str]:
        from kernels_ascend import interpreter_active

        env = {"torch": torch.__version__, "python": platform.python_version()}
        env["mode"] = (
            "unavailable"
            if self.provider is None
            else "emulation (CPU, not an NPU)"
            if self.provider.emulated
            else "npu"
        )
        env["emulated"] = str(bool(self.provider and self.provider.emulated)).lower()
        env["interpreter"] = str(interpreter_active()).lower()
        env["soc"] = self.provider.soc.name if self.provider else "?"
        version, why = _triton_ascend()
        env["triton-ascend"] = version or why
        env["torch_npu"] = self._torch_npu_version()
        env["cann"] = self._cann_version()
        if self.provider is not None and not self.provider.emulated:
            env["device"] = torch.npu.get_device_name()
        for op, p in self.provenance().items():
            env[f"provenance.{op}"] = p
        if self.provider is not None and self.provider.routes:
            env["routes"] = "; ".join(
                f"{op}: {route} x{n}" for (op, route), n in sorted(self.provider.routes.items())
            )
        return env

    def _torch_npu_version(self) -> str:
        if self.provider is not None and not self.provider.emulated:
            return str(self.provider.module.__version__)
        try:
            from importlib.metadata import version

            return f"{version('torch-npu')} (installed, not importable here)"
        except Exception:
            return "not installed"

    @staticmethod
    def _cann_version() -> str:
        import os

        home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
        if not home:
            return "not found (ASCEND_TOOLKIT_HOME unset)"
        for name in ("version.cfg", "ascend_toolkit_install.info"):
            path = os.path.join(home, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        if "version" in line.lower():
                            return line.strip().split("=", 1)[-1]
        return f"unknown ({home})"
