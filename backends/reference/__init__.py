"""The `reference` backend: the contract (SPEC 2) in plain fp32 torch on the CPU, one module per op.

Every other backend is checked against it. An op's module is also its declaration (`DECL`: signature,
fake, validators, limits, sample; backends/contract/decl.py), so the package itself imports nothing at load:
the op table (backends/contract/ops.py) reads these modules, and the backend's class (backend.py) reads the
table.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # the class the registry names (backends.reference:ReferenceBackend), read when first asked for: the
    # package itself stays below the op table, which reads its op modules
    if name == "ReferenceBackend":
        return importlib.import_module("backends.reference.backend").ReferenceBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
