"""Errors shared by every backend."""

from __future__ import annotations


class NotSupported(Exception):
    """A backend cannot serve these inputs. Carries every reason, never a bare refusal.

    Raising it is the only legal way to decline: a backend never returns a wrong answer and never
    falls back to another implementation silently (SPEC 2).
    """

    def __init__(self, reasons: list[str] | str, *, backend: str | None = None, op: str | None = None):
        if isinstance(reasons, str):
            reasons = [reasons]
        self.reasons = list(reasons)
        self.backend = backend
        self.op = op
        where = f"{backend}.{op}" if backend and op else (backend or op or "backend")
        super().__init__(f"{where} not supported: " + "; ".join(self.reasons))


class BackendUnavailable(RuntimeError):
    """`backends.get(name)` on a backend whose `available()` says no (the reason is in the message)."""
