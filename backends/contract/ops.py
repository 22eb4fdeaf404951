"""The ops of the contract (SPEC 2 and 7): the op declarations (`OpDecl`, each in backends/reference/<op>.py).

The conformance matrix's denominator is fixed by this table: every op x every value of its
dtype axis, whatever a backend claims.
"""

from __future__ import annotations

import importlib
import pkgutil

import backends.reference
from backends.contract.decl import OpDecl
from backends.reference._common import FLOATS, FP8, dtype_name

__all__ = ["FLOATS", "FP8", "OPS", "OP_NAMES", "OpSpec", "dtype_name"]

#: what the front door and the conformance suite read of an op (name, spec_section, dtype_axis,
#: dtype_of, validate, values, cache_arg, grad_args): its declaration
OpSpec = OpDecl


def _section_key(d: OpDecl) -> tuple[int, ...]:
    return tuple(int(p) for p in d.spec_section.split("."))


def _load() -> dict[str, OpDecl]:
    """Every `backends/reference/<op>.py`'s `DECL`, in spec-section order (2.1 ... 2.10, then 7.x). The
    reference package imports nothing at load and its op modules import only the leaves of the table
    (backends/contract/decl.py, reference/_common.py, backends/argcheck.py), so reading them here makes no
    cycle."""
    found: list[OpDecl] = []
    for m in pkgutil.iter_modules(backends.reference.__path__):
        if m.name.startswith("_") or m.name == "backend":
            continue
        d = getattr(importlib.import_module(f"backends.reference.{m.name}"), "DECL", None)
        if d is None:
            continue  # a helper module of the reference (fp8_format)
        if not isinstance(d, OpDecl) or d.name != m.name:
            raise TypeError(f"backends.reference.{m.name}: DECL must be the OpDecl of {m.name!r}")
        found.append(d)
    return {d.name: d for d in sorted(found, key=_section_key)}


#: op name -> its declaration (backends/reference/<op>.py: `DECL`), in spec-section order
OPS: dict[str, OpDecl] = _load()

OP_NAMES: tuple[str, ...] = tuple(OPS)
