"""The one seam through which the Ascend backend reaches torch_npu's fused operators.

An `OpsProvider` holds the module whose `npu_*` functions the adapters call: the real `torch_npu`
on an Atlas machine, or `backends.ascend.emulation` (CPU EMULATIONS written from each operator's
documentation) in the explicit emulation mode `GLM5_ASCEND_EMULATE=1`. The adapters never know
which; reports always do (`provider.kind`, `provenance`). There is no silent substitution: without
torch_npu and without the opt-in variable the backend is unavailable, with the import error as reason.

The provider also carries the SoC's documented operator limits (head counts, block sizes), because
those differ between Atlas A2/A3 and Ascend 950 and the adapters pad or decline from them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from backends.ascend._prepared import Forms
from backends.ascend._soc import (  # noqa: F401  (re-exported: the adapters' limits)
    BLOCK_MULTIPLE,
    GMM_MAX_DIM,
    GMM_MAX_GROUPS,
    MAX_BLOCK,
    MAX_SPARSE_COUNT,
    QMM_MAX_LAST_DIM,
    SOCS,
    SPARSE_COUNTS,
    SocLimits,
)

EMULATE_ENV = "GLM5_ASCEND_EMULATE"
SOC_ENV = "GLM5_ASCEND_SOC"

#: The fused operators tile by batch size on the NPU and document no batch invariance (vllm-ascend
#: needs CANN >= 9.2's deterministic level 3 for it), so ops served by them do not claim it.
BATCH_INVARIANT = False


def soc_from_device_name(device_name: str) -> str:
    n = device_name.lower()
    if "950" in n:
        return "950"
    if "910_93" in n or "9391" in n or "9392" in n:
        return "A3"
    return "A2"


@dataclass
class OpsProvider:
    """kind: "torch_npu" or "emulation"; module: what the adapters call `npu_*` on."""

    kind: str
    module: ModuleType | Any
    soc: SocLimits
    device: str
    detail: str
    calls: Counter[str] = field(default_factory=Counter)
    #: (op, route) -> count: which path served each call (fused operator, kernel), for reports
    routes: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: op -> per-call re-layouts of weights that were not prepared (the backend's `relayouts`)
    relayouts: Counter[str] = field(default_factory=Counter)
    #: derived forms of prepared weights (int4 repacks, column blocks): backends/ascend/_prepared.py
    forms: Forms = field(default_factory=Forms)

    @property
    def emulated(self) -> bool:
        return self.kind == "emulation"

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Call the fused operator `op` (e.g. "npu_lightning_indexer"); counted for kernel_calls()."""
        self.calls[op] += 1
        return getattr(self.module, op)(*args, **kwargs)

    def record(self, op: str, route: str) -> None:
        self.routes[(op, route)] += 1

    def label(self, op: str) -> str:
        """Provenance of a fused-operator route, e.g. "torch_npu (emulated): npu_lightning_indexer"."""
        return f"torch_npu (emulated): {op}" if self.emulated else f"torch_npu: {op}"

    def kernel_label(self, name: str) -> str:
        """Provenance of a triton-ascend kernel route."""
        from kernels_ascend import interpreter_active

        how = "triton-ascend (interpreted)" if interpreter_active() else "triton-ascend"
        return f"{how}: kernels_ascend.{name}"


@dataclass
class Resolution:
    provider: OpsProvider | None
    reason: str


def _torch_npu() -> tuple[ModuleType | None, str]:
    """Import torch_npu if it is installed; the true reason if it is not usable."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu is not installed"
    try:
        mod = importlib.import_module("torch_npu")
    except (Exception, SystemExit) as exc:  # old torch_npu calls sys.exit() when CANN is missing
        return (
            None,
            f"torch_npu is installed but fails to import ({type(exc).__name__}: {exc}); is CANN set up?",
        )
    try:
        import torch

        if not torch.npu.is_available():
            return None, f"torch_npu {getattr(mod, '__version__', '?')} imported but sees no NPU device"
    except Exception as exc:
        return None, f"torch_npu imported but the NPU runtime failed ({type(exc).__name__}: {exc})"
    return mod, "ok"


def resolve(env: dict[str, str] | None = None) -> Resolution:
    """Choose the provider: real torch_npu when it works, emulation only when asked for explicitly."""
    env = dict(os.environ) if env is None else env
    soc_key = env.get(SOC_ENV, "A3")
    if soc_key not in SOCS:
        return Resolution(None, f"{SOC_ENV}={soc_key!r}: expected one of {sorted(SOCS)}")
    want_emulation = env.get(EMULATE_ENV, "0") not in ("", "0")
    if want_emulation:
        from backends.ascend import emulation

        soc = SOCS[soc_key]
        return Resolution(
            OpsProvider(
                "emulation",
                emulation.module_for(soc_key),
                soc,
                "cpu",
                f"emulation mode: torch_npu operators emulated on CPU (not an NPU), {soc.name} limits",
            ),
            "ok",
        )
    mod, why = _torch_npu()
    if mod is None:
        return Resolution(
            None,
            f"{why}; on a CPU machine, {EMULATE_ENV}=1 with TRITON_INTERPRET=1 and "
            "triton-ascend installed runs the emulation mode (not an NPU)",
        )
    import torch

    name = torch.npu.get_device_name()
    soc = SOCS[env.get(SOC_ENV) or soc_from_device_name(name)]
    return Resolution(
        OpsProvider("torch_npu", mod, soc, "npu", f"torch_npu {mod.__version__} on {name}"), "ok"
    )
