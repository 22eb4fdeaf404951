"""Borrowing: an op a backend has not ported runs the reference on host copies (SPEC 3.1).

A backend declares what it borrows, by name (`Backend.borrow`); nothing is borrowed otherwise, and an op
neither ported nor borrowed still raises `NotSupported`. A borrowed call copies its tensor arguments (a
`SeqLayout`'s included) to the host, runs the reference's implementation there, and copies the results
back to the device of the inputs; the `BorrowLedger` counts each call, the bytes each way and the wall
time. The conformance suite reports a borrowed op as BORROWED, never as passing.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from backends.caps import OpImpl
from backends.contract.ops import OP_NAMES
from backends.layout import SeqLayout

HOST = torch.device("cpu")


def every_op_except(*ported: str) -> frozenset[str]:
    """The bring-up declaration: borrow every op of the contract but the `ported` ones."""
    check_names(ported, "every_op_except")
    return frozenset(OP_NAMES) - frozenset(ported)


def check_names(ops: Iterable[str], what: str) -> frozenset[str]:
    """`ops` as a frozenset, or TypeError naming the first that is not an op of the contract."""
    if isinstance(ops, str):  # a bare string would borrow its letters
        raise TypeError(f"{what}: expected a set of op names, got the string {ops!r}")
    names = frozenset(ops)
    for op in sorted(names):
        if op not in OP_NAMES:
            raise TypeError(f"{what}: {op!r} is not an op of the contract; known: {', '.join(OP_NAMES)}")
    return names


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _move(value: Any, device: torch.device) -> tuple[Any, int]:
    """`value` with its tensors on `device` (a tuple's, a named tuple's, a SeqLayout's), and their bytes."""
    if isinstance(value, torch.Tensor):
        return value.to(device), _nbytes(value)
    if isinstance(value, SeqLayout):
        return value.to(device), sum(_nbytes(t) for t in value.tensors() if t is not None)
    if isinstance(value, tuple):  # outputs, and named tuples of tensors (an MLAPools cache) kept as such
        moved = [_move(v, device) for v in value]
        items = [v for v, _ in moved]
        return (type(value)(*items) if hasattr(value, "_fields") else tuple(items)), sum(n for _, n in moved)
    return value, 0


def _device_of(args: dict[str, Any], default: str) -> torch.device:
    for v in args.values():
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device(default)


@dataclass
class BorrowLedger:
    """What borrowing cost a backend, per op: calls, bytes copied to the host and back, seconds (wall
    time of copy, reference and copy back; a copy to the host waits for the device)."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes_to_host: Counter[str] = field(default_factory=Counter)
    bytes_to_device: Counter[str] = field(default_factory=Counter)
    seconds: Counter[str] = field(default_factory=Counter)

    def cost(self, op: str) -> dict[str, Any]:
        return {
            "calls": self.calls[op],
            "bytes_to_host": self.bytes_to_host[op],
            "bytes_to_device": self.bytes_to_device[op],
            "seconds": round(self.seconds[op], 6),
        }

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {op: self.cost(op) for op in sorted(self.calls)}


def run_borrowed(ledger: BorrowLedger, op: str, reference: OpImpl, args: dict[str, Any], device: str) -> Any:
    """The reference's `op` on host copies of `args`, its results copied back to the inputs' device."""
    return _on_host(ledger, op, lambda host: reference.fn(**host), args, device)


def _on_host(ledger: BorrowLedger, op: str, fn: Any, args: dict[str, Any], device: str) -> Any:
    """fn(host copies of `args`), its results copied back to the inputs' device; counted under `op`."""
    t0 = time.perf_counter()
    target = _device_of(args, device)
    host: dict[str, Any] = {}
    sent = 0
    for name, value in args.items():
        host[name], n = _move(value, HOST)
        sent += n
    out, back = _move(fn(host), target)
    ledger.calls[op] += 1
    ledger.bytes_to_host[op] += sent
    ledger.bytes_to_device[op] += back
    ledger.seconds[op] += time.perf_counter() - t0
    return out


def reference_impl(op: str) -> OpImpl:
    """The reference's implementation of `op`: `backends.reference.<op>.IMPL` (the op table convention;
    the op module, not the package, so the front door does not import the reference backend's class)."""
    return importlib.import_module(f"backends.reference.{op}").IMPL


def borrowed_impl(ledger: BorrowLedger, op: str, device: str) -> OpImpl:
    """The OpImpl a backend serves a borrowed op with: the reference's capabilities, its function and its
    declared backward each run on host copies (both counted as the op's cost)."""
    reference = reference_impl(op)

    def fn(**args: Any) -> Any:
        return run_borrowed(ledger, op, reference, args, device)

    def backward(args: dict[str, Any], outputs: tuple, grad_outputs: tuple) -> tuple:
        parts = {"args": tuple(args.values()), "outputs": outputs, "grad_outputs": grad_outputs}

        def on_host(host: dict[str, Any]) -> tuple:
            host_args = dict(zip(args, host["args"]))
            return tuple(reference.backward(host_args, host["outputs"], host["grad_outputs"]))

        return _on_host(ledger, op, on_host, parts, device)

    has_backward = reference.backward is not None
    return OpImpl(
        fn,
        reference.caps,
        backward=backward if has_backward else None,
        backward_forces=reference.backward_forces,
        kinds=reference.kinds,  # a cache kind's own caps; `fn` (the reference's entry) picks its kernel
    )
