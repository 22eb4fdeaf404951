"""The outcome of one conformance case on one backend, and the status taxonomy.

PASS; FAIL (wrong numbers, a broken contract, an unclaimed input served, a fallback, no kernel ran);
ERROR (the backend raised on a claimed input); XFAIL / XPASS (a strict expected failure from the
manifest that failed / unexpectedly passed); SKIPPED (manifest); UNSUPPORTED (unclaimed and declined
with `NotSupported`, as it must be); BORROWED (the backend declares the op borrowed: the reference serves
it on host copies, so nothing of the backend's is checked, and the case never counts as passing).
"""

from __future__ import annotations

import shlex
import traceback
from dataclasses import dataclass, field
from typing import Any

from conformance.case import Case
from conformance.compare import Check

PASS, FAIL, ERROR, XFAIL, XPASS, SKIPPED, UNSUPPORTED, BORROWED = (
    "PASS",
    "FAIL",
    "ERROR",
    "XFAIL",
    "XPASS",
    "SKIPPED",
    "UNSUPPORTED",
    "BORROWED",
)
#: statuses that fail a run
FAILING = (FAIL, ERROR, XPASS)
#: statuses that mean the case ran on the backend
RAN = (PASS, FAIL, ERROR, XFAIL, XPASS)


@dataclass
class Result:
    op: str
    backend: str
    dtype: str
    case: str
    status: str
    kernel_calls: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    repro: str = ""
    message: str = ""
    checks: list[Check] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    inputs: str = ""
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backend": self.backend,
            "dtype": self.dtype,
            "case": self.case,
            "status": self.status,
            "kernel_calls": self.kernel_calls,
            "metrics": self.metrics,
            "repro": self.repro,
            "message": self.message,
            "seconds": round(self.seconds, 4),
            "tags": dict(self.tags),
            "inputs": self.inputs,
            "seed": self.seed,
            "worst": {c.output: c.worst for c in self.checks if not c.ok and c.worst},
        }


def repro(backend: str, case: Case, dtype: str) -> str:
    return (
        f"glm5 conformance --backend {shlex.quote(backend)} --ops {case.op} --suite full "
        f"--case {shlex.quote(case.id)} --dtype {dtype}"
    )


def describe(exc: BaseException) -> str:
    """An exception in one line, with where it was raised."""
    tb = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {tb[0].filename}:{tb[0].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
