"""Shadow-check mode (`GLM5_VALIDATE=reference`): every op call on a backend also runs the reference
on CPU copies of the inputs and raises `ShadowMismatch` at the first call whose result differs.

A debugging tool for ports (run a model step on a new chip and learn which op diverged first), like
tinygrad's CPU validation; it costs a reference run per call. Index outputs must match exactly, except
top-k indices of a backend that declares `tie_rule="none"`, where only the selected values are compared.
Float outputs use loose per-dtype tolerances; the conformance suite is where the real tolerances live.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from backends.counters import REFERENCE_CALLS
from backends.layout import SeqLayout

#: (rtol, atol) per output dtype
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3), torch.bfloat16: (3e-2, 1e-2)}


class ShadowMismatch(AssertionError):
    """A backend's result differs from the reference's (GLM5_VALIDATE=reference)."""


def _to_cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, SeqLayout):
        return v.to("cpu")
    return v


def _outputs(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def shadow_check(backend_name: str, op: str, args: dict[str, Any], result: Any, tie_rule: str | None) -> None:
    # the reference's own op module, not its Backend: the arguments were validated by the caller's front
    # door, and the interface (which calls this) must not depend on the registry
    reference_fn = importlib.import_module(f"backends.reference.{op}").IMPL.fn
    before = REFERENCE_CALLS.copy()
    with torch.no_grad():
        expected = reference_fn(**{k: _to_cpu(v) for k, v in args.items()})
    # the shadow run is not a fallback: keep the counters the conformance runner reads unchanged
    REFERENCE_CALLS.clear()
    REFERENCE_CALLS.update(before)
    for i, (got, want) in enumerate(zip(_outputs(result), _outputs(expected), strict=True)):
        if got is None and want is None:  # an output not asked for (lse with return_lse=False)
            continue
        got = got.detach().cpu()
        where = f"{backend_name}.{op} output {i}"
        if got.shape != want.shape or got.dtype != want.dtype:
            have, ref = f"{got.dtype}{list(got.shape)}", f"{want.dtype}{list(want.shape)}"
            raise ShadowMismatch(f"{where}: {have} vs reference {ref}")
        if not got.dtype.is_floating_point:
            if tie_rule == "none":
                continue  # ties not ordered (only top-k ops have a tie rule): their values are compared
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                pair = f"{got[tuple(bad)].item()} vs {want[tuple(bad)].item()}"
                raise ShadowMismatch(f"{where}: first difference at {bad}: {pair}")
            continue
        rtol, atol = TOLERANCES.get(got.dtype, TOLERANCES[torch.float32])
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as exc:
            raise ShadowMismatch(f"{where} differs from the reference:\n{exc}") from None
