"""One convention for every backend's op table (STYLE rule 3).

A backend is a package `backends/<name>/` (or a plugin's own package) with one module per op,
`<package>.<op>`, each defining `IMPL: OpImpl | None`. `load_ops(package)` builds the table in the
order of `backends.contract.ops.OPS` and checks that every implementation takes exactly the op's declared
argument names, so a drifted signature fails at import, not deep inside a conformance case.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from backends.caps import OpImpl
from backends.contract.limits import check_quantities
from backends.contract.ops import OP_NAMES, OPS


def interface_parameters(op: str) -> tuple[str, ...]:
    """The argument names of `op` in order: its declaration's (backends/reference/<op>.py), which
    `Backend.<op>` takes too (checked when backends.interface is imported)."""
    return OPS[op].arg_names


def check_signature(op: str, fn: Callable[..., Any], where: str = "") -> None:
    """Raise TypeError unless `fn` takes the interface's argument names for `op`, in order."""
    want = interface_parameters(op)
    got = tuple(inspect.signature(fn).parameters)
    if got != want:
        at = f" ({where})" if where else ""
        raise TypeError(f"{op}{at}: implementation takes {got}, the interface takes {want}")


def load_ops(package: str, *factory_args: Any, ops: Iterable[str] = OP_NAMES) -> dict[str, OpImpl]:
    """op -> OpImpl from `<package>.<op>.IMPL`, or from `<package>.<op>.impl(*factory_args)` for a
    backend whose implementations close over per-instance state (Ascend's operator provider). A module
    that is absent or has `IMPL = None` leaves the op out of the table (calling it raises NotSupported
    with that reason)."""
    table: dict[str, OpImpl] = {}
    for op in ops:
        name = f"{package}.{op}"
        if importlib.util.find_spec(name) is None:
            continue
        mod = importlib.import_module(name)
        factory = getattr(mod, "impl", None)
        impl = factory(*factory_args) if callable(factory) and factory_args else getattr(mod, "IMPL", None)
        if impl is None:
            continue
        if not isinstance(impl, OpImpl):
            got = type(impl).__name__
            raise TypeError(f"{name}.IMPL: expected a backends.caps.OpImpl or None, got {got}")
        check_signature(op, impl.fn, name)
        check_quantities(op, impl.caps.limits)
        table[op] = impl
    return table
