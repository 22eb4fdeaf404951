"""Run conformance cases against one backend and the CPU reference.

For every (case, dtype): a claimed dtype and layout runs on the backend's device and is compared with
the reference on the CPU copies (outputs, gradients if the backend claims `differentiable`, inputs left
unchanged, run-to-run and batch-invariance bitwise if claimed); an unclaimed one must raise
`NotSupported`, and the backend's raw implementation is probed on it so claims are checked both ways.
Proof that the backend's own code ran: its `kernel_calls()` total must rise, and
`backends.counters.REFERENCE_CALLS` must not (a rise is a silent fallback, a failure).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import backends
from backends.cache_layout import cache_kind
from backends.contract.ops import OPS
from backends.counters import REFERENCE_CALLS
from backends.errors import NotSupported
from backends.interface import Backend
from conformance import cases as case_registry
from conformance.case import Case, args_to, clone_args, host_outputs, outputs, snapshot, summarize
from conformance.comparators import compare
from conformance.compare import Check, Context, bitwise
from conformance.manifest import Manifest, load
from conformance.result import (
    BORROWED,
    ERROR,
    FAIL,
    PASS,
    SKIPPED,
    UNSUPPORTED,
    XFAIL,
    XPASS,
    Result,
    describe,
    repro,
)


def _sum(counter) -> int:
    return sum(counter.values())


class Runner:
    """Runs cases on `backend`; `manifest` defaults to the backend's expectations file."""

    def __init__(
        self,
        backend: Backend,
        manifest: Manifest | None = None,
        on_result: Callable[[Result], None] | None = None,
    ) -> None:
        self.backend = backend
        self.reference = backends.get("reference")
        self.manifest = manifest if manifest is not None else load(backend.expectations_path())
        self.env = {
            k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in backend.environment().items()
        }
        self.on_result = on_result
        self.is_reference = backend.name == "reference"
        #: (op, dtype) -> counters; see `claims()`
        self.claims_seen: dict[tuple[str, str], dict[str, int]] = {}
        #: op -> {"run_to_run"|"batch_invariant": {"claimed": bool, "pass": n, "fail": n}}
        self.determinism: dict[str, dict[str, dict[str, Any]]] = {}

    # -- one case --------------------------------------------------------------------------------
    def run_case(self, case: Case, dtype: str) -> Result:
        t0 = time.perf_counter()
        res = Result(
            case.op,
            self.backend.name,
            dtype,
            case.id,
            PASS,
            repro=repro(self.backend.name, case, dtype),
            tags=dict(case.tags),
        )
        res.seed = case.seed
        key = case.key(dtype)
        exp = self.manifest.expectation(key, self.env)
        if exp is not None and exp.status == "skip":
            res.status, res.message = SKIPPED, f"skipped by manifest: {exp.reason}"
        else:
            try:
                args = case.inputs(dtype)
                res.inputs = summarize(args)
                lay = args.get("layout")
                if isinstance(lay, backends.SeqLayout) and "layout" not in res.tags:
                    cache = args[OPS[case.op].cache_arg]
                    res.tags["layout"] = lay.kind if lay.kind == "ragged" else f"paged_bs{cache.shape[1]}"
                if case.error is not None:
                    self._run_error(case, args, res)
                else:
                    self._run(case, dtype, args, res)
            except Exception as exc:  # a broken case or comparator is an error, never a pass
                res.status, res.message = ERROR, f"harness error: {describe(exc)}"
            if exp is not None and exp.status == "xfail":
                if res.status in (FAIL, ERROR):
                    res.status, res.message = XFAIL, f"expected failure ({exp.reason}): {res.message}"
                elif res.status == PASS:
                    res.status = XPASS
                    res.message = (
                        f"expected to fail ({exp.reason}) but passed: remove the xfail entry {exp.match!r}"
                    )
        res.seconds = time.perf_counter() - t0
        if self.on_result:
            self.on_result(res)
        return res

    def run(self, selection: Iterable[tuple[Case, str]]) -> list[Result]:
        return [self.run_case(c, dt) for c, dt in selection]

    # -- errors/ cases ---------------------------------------------------------------------------
    def _run_error(self, case: Case, args: dict[str, Any], res: Result) -> None:
        etype, pattern = case.error
        try:
            # error cases include faults in tensor values, which the front door checks in values mode
            with self.backend.validating():
                getattr(self.backend, case.op)(**args_to(args, self.backend.device))
        except etype as exc:
            if not re.search(pattern, str(exc)):
                res.status = FAIL
                res.message = (
                    f"raised {type(exc).__name__} as expected, but the message {str(exc)!r} "
                    f"does not match {pattern!r}"
                )
            else:
                res.message = f"raised {type(exc).__name__}: {exc}"
            return
        except Exception as exc:
            res.status, res.message = (
                FAIL,
                f"expected {etype.__name__} matching {pattern!r}, got {describe(exc)}",
            )
            return
        res.status, res.message = FAIL, f"expected {etype.__name__} matching {pattern!r}; the call returned"

    # -- claimed / unclaimed -----------------------------------------------------------------------
    def _claimed(self, op: str, dtype: str, args: dict[str, Any]) -> tuple[bool, str]:
        impl = self.backend.impl(op)
        if impl is None:
            return False, "op not implemented"
        kind = cache_kind(dict(args))
        caps = impl.caps_for(kind)  # a cache kind with its own kernel claims for itself (FP8 rows)
        if dtype not in caps.dtypes:
            return False, f"dtype {dtype} not claimed"
        if kind is not None and kind not in impl.caps.layouts:
            return False, f"{kind} layout not claimed"
        limits = caps.limit_reasons(op, dict(args), dtype)
        if not limits and caps.check is not None:
            limits = caps.check(dict(args))
        if limits:  # outside a declared limit: declining is what the declaration promises
            return False, "outside declared limits (" + "; ".join(limits) + ")"
        return True, ""

    def _claim_counter(self, op: str, dtype: str, claimed: bool) -> dict[str, int]:
        c = self.claims_seen.setdefault(
            (op, dtype),
            {"claimed": 0, "unclaimed": 0, "pass": 0, "fail": 0, "probe_pass": 0, "probe_fail": 0},
        )
        c["claimed" if claimed else "unclaimed"] += 1
        return c

    def _run(self, case: Case, dtype: str, args: dict[str, Any], res: Result) -> None:
        if case.op in self.backend.borrowed:  # the reference would be compared with itself: nothing to check
            res.status = BORROWED
            res.message = f"borrowed: {self.backend.name} runs the reference's {case.op} on host copies"
            return
        claimed, why = self._claimed(case.op, dtype, args)
        counter = self._claim_counter(case.op, dtype, claimed)
        if not claimed:
            self._run_unclaimed(case, dtype, args, res, why, counter)
            return
        checks = self._run_claimed(case, dtype, args, res)
        res.checks = checks
        bad = [c for c in checks if not c.ok]
        if res.status == PASS and bad:
            res.status = FAIL
            res.message = "; ".join(c.message for c in bad)
        counter["pass" if res.status == PASS else "fail"] += 1

    def _run_unclaimed(
        self, case: Case, dtype: str, args: dict[str, Any], res: Result, why: str, counter: dict[str, int]
    ) -> None:
        dev = args_to(clone_args(args), self.backend.device)
        try:
            getattr(self.backend, case.op)(**dev)
            res.status, res.message = (
                FAIL,
                f"{why}, yet the call returned: an unclaimed input must raise NotSupported",
            )
        except NotSupported as exc:
            res.status, res.message = UNSUPPORTED, "; ".join(exc.reasons)
        except Exception as exc:
            res.status = FAIL
            res.message = f"{why}: must raise NotSupported, raised {describe(exc)}"
        impl = self.backend.ops.get(case.op)
        if impl is None or case.suite == "limits":  # a bound is a worst case: random data may pass past it
            return
        try:  # the raw implementation, past the capability check: does the claim undersell it?
            out = impl.fn(**args_to(clone_args(args), self.backend.device))
            ok = all(c.ok for c in self._compare(case, dtype, args, host_outputs(out)))
        except Exception:
            ok = False
        counter["probe_pass" if ok else "probe_fail"] += 1

    def _reference(self, case: Case, args: dict[str, Any]) -> tuple:
        return host_outputs(getattr(self.reference, case.op)(**clone_args(args)))

    def _compare(
        self, case: Case, dtype: str, args: dict[str, Any], got: tuple, expected: tuple | None = None
    ) -> list[Check]:
        expected = expected if expected is not None else self._reference(case, args)
        caps = self.backend.capabilities(case.op)
        ctx = Context(
            case.op,
            dtype,
            args,
            tie_rule=None if self.is_reference else (caps.tie_rule if caps else None),
            reference=self.reference,
        )
        if len(got) != len(expected):
            return [Check("outputs", False, f"returned {len(got)} outputs, expected {len(expected)}")]
        checks = []
        for spec, a, r in zip(case.outputs, got, expected, strict=False):
            params, _ = self.manifest.tolerances(case.key(dtype), spec.name, self.env)
            checks.append(compare(spec.name, spec.comparator, a, r, ctx, dict(spec.params) | params))
        return checks

    def _call(self, op: str, args: dict[str, Any]) -> tuple[tuple, int, int]:
        """Run the backend: (CPU outputs, kernel calls, reference calls during the call)."""
        k0, r0 = _sum(self.backend.kernel_calls()), _sum(REFERENCE_CALLS)
        out = getattr(self.backend, op)(**args)
        got = host_outputs(out)  # the copy to the host also waits for the device
        return got, _sum(self.backend.kernel_calls()) - k0, _sum(REFERENCE_CALLS) - r0

    def _run_claimed(self, case: Case, dtype: str, args: dict[str, Any], res: Result) -> list[Check]:
        dev = args_to(clone_args(args), self.backend.device)
        before = snapshot(dev)
        try:
            got, kcalls, rcalls = self._call(case.op, dev)
        except NotSupported as exc:
            res.status, res.message = (
                FAIL,
                f"claimed {dtype}, but raised NotSupported: {'; '.join(exc.reasons)}",
            )
            return []
        except Exception as exc:
            res.status, res.message = ERROR, describe(exc)
            return []
        res.kernel_calls = kcalls
        caps = self.backend.capabilities(case.op)
        checks: list[Check] = []
        if rcalls and not self.is_reference:
            checks.append(
                Check(
                    "fallback",
                    False,
                    f"fallback: the reference implementation ran {rcalls} time(s) "
                    f"inside {self.backend.name}.{case.op}",
                )
            )
        if kcalls <= 0 and not case.trivial:
            checks.append(
                Check(
                    "kernel_calls",
                    False,
                    f"{self.backend.name}.kernel_calls() did not rise: the backend's own code did not run",
                )
            )
        after = snapshot(dev)
        unchanged = bitwise("inputs", before, after)
        if not unchanged.ok:
            unchanged.message = "the backend modified its inputs: " + unchanged.message
            checks.append(unchanged)
        expected = self._reference(case, args)
        checks += self._compare(case, dtype, args, got, expected)
        ref_tie = self.reference.capabilities(case.op).tie_rule
        if ref_tie is not None:  # the tie rule is checked by the index comparators; report which contract
            tie = self._det_counter(
                case.op, "tie_rule", None if self.is_reference else caps.tie_rule == ref_tie
            )
            tie["claimed"] = True if self.is_reference else caps.tie_rule == ref_tie
            tie["pass" if all(c.ok for c in checks) else "fail"] += 1
        # gradients reach floating-point arguments only (grouped_matmul's integer variants have none)
        grad_args = tuple(n for n in case.grad_args if args[n].dtype.is_floating_point)
        if grad_args and caps.differentiable:
            checks += self._grad_checks(dataclasses.replace(case, grad_args=grad_args), dtype, args)
        checks += self._determinism(case, args, got, expected, caps)
        res.metrics = {c.output: c.metrics for c in checks if c.metrics}
        return checks

    # -- gradients and determinism -----------------------------------------------------------------
    def _grads(self, be: Backend, case: Case, args: dict[str, Any], device: str) -> list[torch.Tensor | None]:
        a = args_to(clone_args(args), device)
        for n in case.grad_args:
            a[n] = a[n].detach().requires_grad_(True)
        outs = outputs(getattr(be, case.op)(**a))
        g = torch.Generator().manual_seed(case.seed ^ 0x5EED)
        loss = 0.0
        for o in outs:
            if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad:
                cot = torch.randn(o.shape, generator=g).to(o.device)
                loss = loss + (torch.where(torch.isfinite(o), o, 0).float() * cot).sum()
        if not isinstance(loss, torch.Tensor):
            return [None for _ in case.grad_args]
        loss.backward()
        return [None if a[n].grad is None else a[n].grad.detach().cpu() for n in case.grad_args]

    def _grad_checks(self, case: Case, dtype: str, args: dict[str, Any]) -> list[Check]:
        try:
            got = self._grads(self.backend, case, args, self.backend.device)
        except Exception as exc:
            return [Check("grad", False, f"backward failed: {describe(exc)}")]
        want = self._grads(self.reference, case, args, "cpu")
        ctx = Context(case.op, dtype, args, reference=self.reference)
        out = []
        for n, a, r in zip(case.grad_args, got, want, strict=True):
            if a is None:
                out.append(Check(f"grad:{n}", False, f"grad:{n}: no gradient reached {n}"))
                continue
            params, _ = self.manifest.tolerances(case.key(dtype), f"grad:{n}", self.env)
            out.append(compare(f"grad:{n}", "grad", a, r, ctx, params))
        return out

    def _det_counter(self, op: str, what: str, claimed: bool | None) -> dict[str, Any]:
        d = self.determinism.setdefault(op, {}).setdefault(what, {"claimed": claimed, "pass": 0, "fail": 0})
        return d

    def _rerun(self, op: str, args: dict[str, Any]) -> tuple:
        return self._call(op, args_to(clone_args(args), self.backend.device))[0]

    def _determinism(
        self, case: Case, args: dict[str, Any], got: tuple, expected: tuple, caps
    ) -> list[Check]:
        out = []
        r2r = self._det_counter(case.op, "run_to_run", caps.run_to_run)
        if caps.run_to_run:
            # the reference's expected outputs were a second run of the same code on the same inputs
            try:
                again = expected if self.is_reference else self._rerun(case.op, args)
                c = bitwise("run_to_run", got, again)
            except Exception as exc:
                c = Check("run_to_run", False, f"run_to_run: the second run raised {describe(exc)}")
            r2r["pass" if c.ok else "fail"] += 1
            out.append(c)
        subset = case_registry.batch_subset(case.op)
        sub = subset(clone_args(args)) if subset else None
        bi = self._det_counter(case.op, "batch_invariant", caps.batch_invariant if subset else None)
        if sub is not None and caps.batch_invariant:
            sub_args, pick = sub
            try:
                c = bitwise("batch_invariant", self._rerun(case.op, sub_args), outputs(pick(got)))
            except Exception as exc:
                c = Check("batch_invariant", False, f"batch_invariant: the subset run raised {describe(exc)}")
            if not c.ok:
                c.message = "rows run alone differ from the same rows in the full batch: " + c.message
            bi["pass" if c.ok else "fail"] += 1
            out.append(c)
        return out

    # -- summaries -----------------------------------------------------------------------------
    def claims(self) -> list[dict[str, Any]]:
        """Claims checked both ways: claimed dtypes that fail; unclaimed dtypes (or declined layouts and
        limits of a claimed one) on which the raw implementation passes."""
        out = []
        for (op, dtype), c in sorted(self.claims_seen.items()):
            caps = self.backend.capabilities(op)
            dtype_claimed = caps is not None and dtype in caps.dtypes
            what = "declined inputs (layout or limits)" if dtype_claimed else "not claimed"
            verdict = "ok"
            if c["claimed"] and c["fail"]:
                verdict = "claimed, but failing"
            elif c["unclaimed"] and c["probe_pass"] and not c["probe_fail"]:
                verdict = f"{what}, but the implementation passes every such case: consider claiming it"
            elif c["unclaimed"] and c["probe_pass"]:
                verdict = (
                    f"{what}; the implementation passes {c['probe_pass']} of {c['unclaimed']} such cases"
                )
            out.append(
                {
                    "backend": self.backend.name,
                    "op": op,
                    "dtype": dtype,
                    "claimed_dtype": dtype_claimed,
                    "verdict": verdict,
                    **c,
                }
            )
        return out
