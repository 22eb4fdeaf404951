"""Call counters: proof of which implementation actually ran.

`REFERENCE_CALLS` is incremented inside every reference op function, whoever calls it, so a backend
that quietly calls the reference is caught (the conformance runner treats a rise during a non-reference
backend's call as a fallback, i.e. a failure). Backends count their own kernel launches.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

REFERENCE_CALLS: Counter[str] = Counter()


def reference_op(op: str) -> Callable[[F], F]:
    """Mark a function as the reference implementation of `op` (counted in REFERENCE_CALLS)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            REFERENCE_CALLS[op] += 1
            return fn(*args, **kwargs)

        return counted  # type: ignore[return-value]

    return wrap
