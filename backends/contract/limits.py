"""Typed limits: the measurable quantities of each op's arguments a backend may bound (STYLE rule 4).

A backend declares `Limit("k", max=8192, reason=...)` in its `OpCaps.limits`; the front door declines
arguments past it with that reason (`NotSupported`), and the conformance suite builds a case at the
limit (must pass against the reference) and one just past it (must be declined, or, for a `route`
limit, must still pass: past it the backend serves the op by another route with another cost class).
Free-text facts that are not bounds go to `OpCaps.notes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Quantity = Callable[[dict[str, Any]], int | None]


def quantities(op: str) -> Mapping[str, Quantity]:
    """quantity -> how to measure it on `op`'s interface arguments (no host reads): its declaration's
    (read when first asked: the op modules that declare them build their limits with this module)."""
    from backends.contract.ops import OPS

    d = OPS.get(op)
    return {} if d is None else d.quantities


def __getattr__(name: str) -> Any:
    if name == "QUANTITIES":  # op -> quantity -> measure, every op's
        from backends.contract.ops import OPS

        return {op: d.quantities for op, d in OPS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Limit:
    """quantity: a name in QUANTITIES[op]; max / min: inclusive bounds; reason: why (shown to users);
    route: past the bound the op still runs, by this other route (e.g. "exact O(C^2) per-row top-k"),
    so it is a cost class to know about, not a refusal. `when`: the dtype-axis values it applies to
    (empty: all), e.g. ("w8a8",) for an int32-accumulator bound on grouped_matmul."""

    quantity: str
    max: int | None = None
    min: int | None = None
    reason: str = ""
    route: str | None = None
    when: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max is None and self.min is None:
            raise ValueError(f"Limit {self.quantity!r}: expected max or min")
        if not self.reason:
            raise ValueError(f"Limit {self.quantity!r}: expected a reason")

    def describe(self) -> str:
        bound = " and ".join(
            b
            for b in (
                f">= {self.min}" if self.min is not None else "",
                f"<= {self.max}" if self.max is not None else "",
            )
            if b
        )
        past = f"; past it: {self.route}" if self.route else ""
        on = f" ({', '.join(self.when)})" if self.when else ""
        return f"{self.quantity}{on} {bound}: {self.reason}{past}"

    def violation(self, op: str, args: dict[str, Any], dtype: str) -> str | None:
        """The reason these arguments are past this limit, else None."""
        if self.when and dtype not in self.when:
            return None
        known = quantities(op)
        measure = known.get(self.quantity)
        if measure is None:
            raise ValueError(f"Limit {self.quantity!r} is not a known quantity of {op} ({sorted(known)})")
        v = measure(args)
        if v is None:
            return None
        if self.max is not None and v > self.max:
            return f"{self.quantity}={v} > {self.max}: {self.reason}"
        if self.min is not None and v < self.min:
            return f"{self.quantity}={v} < {self.min}: {self.reason}"
        return None


def check_quantities(op: str, limits: tuple[Limit, ...]) -> None:
    """Raise ValueError for a limit on a quantity the op does not have (a typo would never fire)."""
    known = quantities(op)
    for lim in limits:
        if lim.quantity not in known:
            raise ValueError(f"{op}: limit on {lim.quantity!r}; the op's quantities are {sorted(known)}")
