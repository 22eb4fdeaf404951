"""Case generators, one module per op (`conformance/cases/<op>.py`), each exporting

CASES: list[Case]                                  smoke, realistic, adversarial and errors cases
batch_subset(args) -> (sub_args, pick) | None      rows/requests run alone for batch invariance;
                                                   pick(full outputs) -> the matching rows
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Iterable
from types import ModuleType

import torch

from backends.contract.ops import OP_NAMES, OPS
from conformance.case import SUITE_SETS, Case


def module(op: str) -> ModuleType:
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OP_NAMES)}, got {op!r}")
    return importlib.import_module(f"conformance.cases.{op}")


def declared_case(op: str, cases: list[Case]) -> Case:
    """The op's first smoke case, from its declaration's sample (backends/reference/<op>.py), on the dtypes
    the sample builds (it must make `dtype_of` that value), compared as the op's other cases are."""
    d = OPS[op]
    outputs = next(c.outputs for c in cases if c.outputs)
    probe = torch.Generator()
    dtypes = tuple(dt for dt in d.dtype_axis if d.dtype_of(d.sample(probe.manual_seed(0), dt, False)) == dt)
    return Case(
        op,
        "smoke/declared_sample",
        lambda g, dt: d.sample(g, dt, False),
        outputs,
        dtypes=dtypes,
        grad_args=d.grad_args,
        tags={"from": d.signature.__module__.replace(".", "/") + ".py"},
    )


def cases(op: str) -> list[Case]:
    listed = list(module(op).CASES)
    out = [declared_case(op, listed), *listed]
    seen = set()
    for c in out:
        if c.id in seen:
            raise ValueError(f"duplicate case id {op}/{c.id}")
        seen.add(c.id)
    return out


def batch_subset(op: str) -> Callable | None:
    return getattr(module(op), "batch_subset", None)


def dtypes_of(case: Case) -> tuple[str, ...]:
    axis = OPS[case.op].dtype_axis
    return axis if case.dtypes is None else tuple(d for d in axis if d in case.dtypes)


def select(
    ops: Iterable[str] | None = None,
    suite: str = "full",
    case_glob: str | None = None,
    dtypes: Iterable[str] | None = None,
) -> list[tuple[Case, str]]:
    """Every (case, dtype) of the selection, in op-table order."""
    if suite not in SUITE_SETS:
        raise ValueError(f"suite: expected one of {', '.join(SUITE_SETS)}, got {suite!r}")
    suites = SUITE_SETS[suite]
    want = None if dtypes is None else set(dtypes)
    ops = list(ops or OP_NAMES)
    for op in ops:
        module(op)  # an unknown op name raises here
    known = {d for op in ops for d in OPS[op].dtype_axis}
    if want is not None and want - known:
        raise ValueError(
            f"dtype: expected values of the selected ops' dtype axes {sorted(known)}, "
            f"got {sorted(want - known)}"
        )
    out = []
    for op in ops or OP_NAMES:
        for c in cases(op):
            if c.suite not in suites or (case_glob and not fnmatch.fnmatchcase(c.id, case_glob)):
                continue
            for dt in dtypes_of(c):
                if want is None or dt in want:
                    out.append((c, dt))
    return out


def for_backend(
    backend,
    ops: Iterable[str] | None = None,
    suite: str = "full",
    case_glob: str | None = None,
    dtypes: Iterable[str] | None = None,
) -> list[tuple[Case, str]]:
    """`select(...)` plus the `limits/` cases of this backend's declared bounds."""
    out = select(ops, suite, case_glob, dtypes)
    if "limits" not in SUITE_SETS[suite]:
        return out
    from conformance.cases.limits import limit_cases

    want = None if dtypes is None else set(dtypes)
    for op in list(ops or OP_NAMES):
        caps = backend.capabilities(op)
        if caps is None or not caps.limits:
            continue
        outputs = next((c.outputs for c in cases(op) if c.outputs), ())
        for c, dt in limit_cases(op, caps.limits, caps.dtypes, outputs):
            if (case_glob and not fnmatch.fnmatchcase(c.id, case_glob)) or (
                want is not None and dt not in want
            ):
                continue
            out.append((c, dt))
    return out
