"""`limits/` cases, generated from a backend's declared limits (`backends.contract.limits.Limit`).

For every limit: one case with the quantity AT its bound (the backend claims it: it must pass against
the reference) and one JUST PAST it (the backend must decline it with NotSupported; for a `route`
limit it still claims it, by the other route, and must pass). The inputs are the op declaration's
`sized` (in the op's declaration: the smallest valid arguments with one quantity set); a bound whose case
would not fit in a CPU run's memory is left out (the front door still enforces it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from backends.contract.limits import Limit
from backends.contract.ops import OPS
from conformance.case import Case, Output

#: elements a generated input may have (a CPU run of the suite must stay small)
MAX_ELEMENTS = 1 << 25


def _builder(op: str, q: str, v: int, dt: str) -> Callable[[torch.Generator, str], dict[str, Any]]:
    """Arguments with quantity `q` of `op` at `v` on dtype-axis value `dt` (the declaration's `sized`)."""
    sized = OPS[op].sized
    return lambda g, _dt: sized(g, dt, q, v)


def _elements(args: dict[str, Any]) -> int:
    return sum(t.numel() for t in args.values() if isinstance(t, torch.Tensor))


def limit_cases(
    op: str, limits: Iterable[Limit], dtypes: tuple[str, ...], outputs: tuple[Output, ...]
) -> list[tuple[Case, str]]:
    """(case, dtype) pairs at and just past each bound of `limits` for the dtypes the backend claims;
    `outputs`: the op's comparators (those of its other cases)."""
    out: list[tuple[Case, str]] = []
    axis = OPS[op].dtype_axis
    if OPS[op].sized is None:
        return out  # its declaration builds no sized inputs: its bounds are enforced, not generated
    for lim in limits:
        for bound, past in ((lim.max, 1), (lim.min, -1)):
            if bound is None:
                continue
            for value, where in ((bound, "at"), (bound + past, "past")):
                if value < 1:
                    continue
                for dt in [d for d in axis if d in dtypes and (not lim.when or d in lim.when)]:
                    built = _builder(op, lim.quantity, value, dt)
                    name = f"limits/{lim.quantity}_{where}_{value}"
                    probe = built(torch.Generator().manual_seed(0), dt) if value <= MAX_ELEMENTS else None
                    if probe is None or _elements(probe) > MAX_ELEMENTS:
                        continue  # too large for a CPU run; the bound is still enforced by the front door
                    out.append((Case(op, name, built, outputs, tags={"limit": lim.describe()}), dt))
    return out
