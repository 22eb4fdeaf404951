"""Capabilities are data with reasons (STYLE rule 4).

A backend declares, per op, what it serves: the values of the op's dtype axis (see
`backends.contract.ops.OPS`), cache layouts, limits, and determinism claims. `reasons(...)` turns a
declaration plus concrete arguments into the list of reasons it cannot serve them; the conformance
suite generates cases from the same declarations and checks the claims both ways.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from backends.cache_layout import FP8_KINDS, cache_kind
from backends.contract.limits import Limit
from backends.invariant import engine as invariant

TIE_RULES = ("lower_index", "none")
#: cache kinds an attention-like op may serve (`backends.cache_layout.cache_kind`): one tensor ragged or
#: paged, paged as split pools (`MLAPools`, sparse_mla_attention only), or FP8 rows ragged or paged (uint8:
#: FlashMLA's 656-byte latent rows, or the FP8 indexer cache; SPEC 7.8)
CACHE_KINDS = ("ragged", "paged", "pools", *FP8_KINDS)


@dataclass(frozen=True)
class OpCaps:
    """What one backend promises for one op.

    dtypes: values of the op's dtype axis it serves (e.g. "float32", "bfloat16"; "w8a8" for grouped_matmul).
    layouts: cache kinds served by attention-like ops ("ragged", "paged", "pools": a paged latent cache
      as split pools, "fp8_ragged" / "fp8_paged": FP8 rows; backends.cache_layout); empty for other ops.
    limits: typed bounds on measurable quantities (`backends.contract.limits.Limit`): enforced by the front
    door
      with their reasons, and tested at and just past each bound by the conformance suite.
    notes: free-text facts shown in reports that are not bounds (a route taken, a precision note). A
      bound is a `Limit`: free text given as `limits` is refused (it would be enforced and tested by nothing).
    check: extra reasons from the concrete, already-validated arguments (what no Limit expresses).
    run_to_run: bitwise-identical results for identical inputs, every run.
    batch_invariant: a row's result does not depend on the other rows of the batch (bitwise).
    tie_rule: "lower_index" (SPEC 2.3 holds bitwise) or "none" (weaker contract); None if the op has no ties.
    differentiable: backward is implemented (tested through autograd).
    layout_invariant: runs the layout-invariant mode of SPEC 12 (exact products, fixed trees and formulas
      while `backends.invariant.engine.active()`); the mode refuses a backend whose op lacks it.
    """

    dtypes: tuple[str, ...]
    layouts: tuple[str, ...] = ()
    limits: tuple[Limit, ...] = ()
    check: Callable[[dict[str, Any]], list[str]] | None = None
    run_to_run: bool = True
    batch_invariant: bool = True
    tie_rule: str | None = None
    differentiable: bool = False
    layout_invariant: bool = False
    notes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.limits, Mapping):
            raise ValueError(
                "limits: expected backends.contract.limits.Limit entries, "
                f"got free text {dict(self.limits)!r} "
                "(a bound: Limit(quantity, max=..., reason=...); a fact that is not a bound: notes=...)"
            )
        if isinstance(self.limits, Limit):
            object.__setattr__(self, "limits", (self.limits,))
        else:
            object.__setattr__(self, "limits", tuple(self.limits))
        for lim in self.limits:
            if not isinstance(lim, Limit):
                raise ValueError(
                    f"limits: expected backends.contract.limits.Limit entries, got {type(lim).__name__}"
                )
        if self.tie_rule is not None and self.tie_rule not in TIE_RULES:
            raise ValueError(f"tie_rule: expected one of {TIE_RULES} or None, got {self.tie_rule!r}")
        for lay in self.layouts:
            if lay not in CACHE_KINDS:
                raise ValueError(f"layouts: expected entries of {CACHE_KINDS}, got {lay!r}")

    def limit_reasons(self, op: str, args: dict[str, Any], dtype: str) -> list[str]:
        """Why these arguments are past a (non-route) declared limit; [] if within every one."""
        out = []
        for lim in self.limits:
            if lim.route is None:
                why = lim.violation(op, args, dtype)
                if why:
                    out.append(why)
        return out

    def describe_limits(self) -> dict[str, str]:
        """Limits and notes as text, for reports."""
        return {lim.quantity: lim.describe() for lim in self.limits} | {
            k: str(v) for k, v in self.notes.items()
        }


@dataclass(frozen=True)
class OpImpl:
    """One op as a backend serves it: the function (taking the SPEC's argument names), its caps, and
    optionally `prepare`: weight arguments (name -> tensor) -> the same weights in the backend's layout,
    run once at load by `Backend.prepare` (same logical shape, dtype and values).

    `backward(args, outputs, grad_outputs)` -> one gradient per `OPS[op].grad_args` (a tensor each, zeros
    where none flows): the one way an op is differentiated, declared by every op whose caps claim
    `differentiable`, from the saved inputs and the forward's own outputs (sparse attention's out and
    lse, linear cross-entropy's per-row lse; indexer_logits saves none: None), so training runs each
    forward once. It runs inside a custom op, without autograd: explicit formulas or the backend's own
    backward kernels. `backward_forces`: forward arguments the backward needs when a gradient will be
    taken (sparse attention: return_lse=True)."""

    fn: Callable[..., Any]
    caps: OpCaps
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    backward: Callable[[dict[str, Any], tuple, tuple], tuple] | None = None
    backward_forces: dict[str, Any] | None = None
    #: cache kind -> what serves a cache of that kind when it is not `fn` itself (its own caps: dtypes,
    #: limits, no backward): FP8 rows read by the backend's FP8 kernel. Built by `by_kind`, whose `fn`
    #: picks the kind's; the kinds are added to `caps.layouts`.
    kinds: Mapping[str, OpImpl] = field(default_factory=dict)

    def __post_init__(self) -> None:
        extra = tuple(k for k in self.kinds if k not in self.caps.layouts)
        if extra:
            object.__setattr__(self, "caps", replace(self.caps, layouts=self.caps.layouts + extra))
        if self.caps.differentiable and self.backward is None:
            raise ValueError(
                "backward: an op whose caps claim differentiable declares its backward "
                "(OpImpl.backward(args, outputs, grad_outputs) -> one gradient per grad argument)"
            )

    def caps_for(self, kind: str | None) -> OpCaps:
        """The caps that answer for a cache of `kind` (the kind's own where it has one)."""
        impl = self.kinds.get(kind) if self.kinds else None
        return self.caps if impl is None else impl.caps


def by_kind(base: OpImpl, kinds: Mapping[str, OpImpl]) -> OpImpl:
    """`base`, with the cache kinds in `kinds` served by their own implementation: the one entry of an op
    whose cache kind picks the kernel (FlashMLA's `is_fp8_kvcache`, vLLM's `kv_cache_dtype`). The choice
    is made from the arguments (`cache_kind`), so a shadow check or a borrowed call of the reference's
    entry picks the same way. In the layout-invariant mode (SPEC 12) a kind whose kernel does not declare
    `layout_invariant` is refused (the mode's `require` checks the ops' own entries only)."""
    kinds = dict(kinds)

    @functools.wraps(base.fn)
    def fn(**args: Any) -> Any:
        kind = cache_kind(args)
        impl = kinds.get(kind)
        if impl is None:
            return base.fn(**args)
        if not impl.caps.layout_invariant and invariant.active():
            raise invariant.NotLayoutInvariant(
                f"{kind} cache: {base.fn.__name__}'s kernel for it does not declare layout_invariant, so the "
                "layout-invariant mode cannot read it (use kv_cache_dtype 'auto': the model dtype's caches)"
            )
        return impl.fn(**args)

    return replace(base, fn=fn, kinds=kinds)
