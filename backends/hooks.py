"""The front door's one instrument: hooks that observe op calls and may override an op's result.

A hook is installed on a backend for a block (`with backend.hooked(hook):`, stackable) or for the life of
a view of the backend (`backend.with_hooks(hook)`: same table, counters and custom-op key, its own hooks;
for a model that always runs hooked while other models share the backend unhooked; installing or removing
one rebuilds the backend's doors, backends/contract/door.py). At every call of an op method, after the
arguments are validated:
- `override(backend, op, args)`: consulted from the most recently installed hook outwards; the first
  result other than `NOT_OVERRIDDEN` is the op's result and the backend's implementation does not run.
  The calls a hook's override makes on the same backend go through the front door (validated,
  observed) but are not offered to that hook's override again (no recursion);
- `observe(backend, op, args, out)`: every installed hook, in installation order, sees the result the
  caller gets.
Hooks run in Python at the front door: under torch.compile they run while tracing (on fake tensors);
what runs inside the compiled graph is counted by `Backend.calls` and shadow-checked by `run`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

#: the `backends.interface.Backend` a hook is called with (typed Any: this module sits below the interface)
Backend = Any


class _NotOverridden:
    def __repr__(self) -> str:
        return "NOT_OVERRIDDEN"


#: what `Hook.override` returns to let the backend (or an outer hook) serve the call
NOT_OVERRIDDEN: Any = _NotOverridden()


class Hook:
    """Base of front-door hooks: override nothing, observe nothing; subclasses define either or both."""

    def override(self, backend: Backend, op: str, args: dict[str, Any]) -> Any:
        return NOT_OVERRIDDEN

    def observe(self, backend: Backend, op: str, args: dict[str, Any], out: Any) -> None:
        return None


class Recorder(Hook):
    """Records `(op, out)` of every call of `ops` (every op if None), outputs detached, on the host."""

    def __init__(self, ops: Collection[str] | None = None) -> None:
        self.ops = None if ops is None else frozenset(ops)
        self.calls: list[tuple[str, Any]] = []

    def observe(self, backend: Backend, op: str, args: dict[str, Any], out: Any) -> None:
        if self.ops is None or op in self.ops:
            self.calls.append((op, _host(out)))

    def outputs(self, op: str) -> list[Any]:
        """The recorded outputs of `op`, in call order."""
        return [out for name, out in self.calls if name == op]


def _host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_host(v) for v in x)
    return x


def call_hooked(
    backend: Backend, op: str, args: dict[str, Any], serve: Callable[[dict[str, Any]], Any]
) -> Any:
    """`serve(args)` (the backend's own path) unless a hook overrides it, then every observer."""
    hooks = backend.hooks
    busy = backend.hooks_busy
    out = NOT_OVERRIDDEN
    for hook in reversed(hooks):
        if id(hook) in busy or type(hook).override is Hook.override:
            continue
        busy.add(id(hook))
        try:
            out = hook.override(backend, op, args)
        finally:
            busy.discard(id(hook))
        if out is not NOT_OVERRIDDEN:
            break
    if out is NOT_OVERRIDDEN:
        out = serve(args)
    for hook in hooks:
        hook.observe(backend, op, args, out)
    return out
