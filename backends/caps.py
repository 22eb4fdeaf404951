"""Capabilities are data with reasons (STYLE rule 4).

A backend declares, per op, what it serves: the values of the op's dtype axis (see
`backends.ops.OPS`), cache layouts, limits, and determinism claims. `reasons(...)` turns a
declaration plus concrete arguments into the list of reasons it cannot serve them; the conformance
suite generates cases from the same declarations and checks the claims both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TIE_RULES = ("lower_index", "none")


@dataclass(frozen=True)
class OpCaps:
    """What one backend promises for one op.

    dtypes: values of the op's dtype axis it serves (e.g. "float32", "bfloat16"; "w8a8" for grouped_matmul).
    layouts: cache layouts served by attention-like ops ("ragged", "paged"); empty for other ops.
    limits: documented limits, name -> value, shown in reports (e.g. {"heads": "power of two"}).
    check: extra reasons from the concrete, already-validated arguments (limits enforced here).
    run_to_run: bitwise-identical results for identical inputs, every run.
    batch_invariant: a row's result does not depend on the other rows of the batch (bitwise).
    tie_rule: "lower_index" (SPEC 2.3 holds bitwise) or "none" (weaker contract); None if the op has no ties.
    differentiable: backward is implemented (tested through autograd).
    """

    dtypes: tuple[str, ...]
    layouts: tuple[str, ...] = ()
    limits: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[dict[str, Any]], list[str]] | None = None
    run_to_run: bool = True
    batch_invariant: bool = True
    tie_rule: str | None = None
    differentiable: bool = False

    def __post_init__(self) -> None:
        if self.tie_rule is not None and self.tie_rule not in TIE_RULES:
            raise ValueError(f"tie_rule: expected one of {TIE_RULES} or None, got {self.tie_rule!r}")
        for lay in self.layouts:
            if lay not in ("ragged", "paged"):
                raise ValueError(f"layouts: expected 'ragged' or 'paged', got {lay!r}")


@dataclass(frozen=True)
class OpImpl:
    """One op as a backend serves it: the function (taking the SPEC's argument names), its caps, and
    optionally `prepare`: weight arguments (name -> tensor) -> the same weights in the backend's layout,
    run once at load by `Backend.prepare` (same logical shape, dtype and values)."""

    fn: Callable[..., Any]
    caps: OpCaps
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
