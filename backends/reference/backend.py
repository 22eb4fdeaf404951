"""The `reference` backend's class: the contract (SPEC 2) in plain fp32 torch on the CPU (the op modules
beside it serve it, one per op: backends/reference/<op>.py)."""

from __future__ import annotations

import platform

import torch

from backends.contract.table import load_ops
from backends.interface import Backend


class ReferenceBackend(Backend):
    name = "reference"
    device = "cpu"
    #: backends/reference/<op>.py for every op; each module's IMPL gives its capabilities
    ops = load_ops("backends.reference")

    def environment(self) -> dict[str, str]:
        return {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
