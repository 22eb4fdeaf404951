"""The backend interface: one method per op of SPEC 2, with the argument names of SPEC 6.

`Backend` does what every backend shares, in two halves:
- the front door (the op methods, each calling its door `self._doors[op]`, built once per op by
  backends/contract/door.py): validate shapes, dtypes and devices (each declaration's `validate`, no host
  reads), value-check a layout once per `SeqLayout` object (every value check on every call only under
  GLM5_VALIDATE=values), check the declared capabilities and raise `NotSupported` with every reason,
  then call the implementation (plain eager) or the op's torch custom op `torch.ops.glm5.<op>`
  (`backends/contract/library.py`), which `torch.compile`, `torch.export` and CUDA graphs see as one opaque
  node; hooks installed with `hooked` / `with_hooks` (backends/hooks.py) observe each call and may
  override its result;
- `run`, which the custom op calls at run time: count the call, run the backend's implementation from
  its `ops` table and, under GLM5_VALIDATE=reference, shadow-check it.
A backend subclass is a table (op name -> `OpImpl`, built by `backends.contract.table.load_ops`) plus
`available()`; anything not in its table raises `NotSupported`, nothing is inherited from the reference
unless the backend declares it borrowed (`borrow`, backends/borrow.py: the reference on host copies).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.borrow import BorrowLedger, borrowed_impl, check_names
from backends.cache_layout import ONE_TENSOR, MLACacheLayout
from backends.caps import OpCaps, OpImpl
from backends.contract import custom_op
from backends.contract.decl import check_interface
from backends.contract.door import build_door, caps_reasons, device_reasons
from backends.contract.ops import OPS
from backends.contract.typed_fp8 import FP8Ops
from backends.contract.typed_ops import ContractOps
from backends.hooks import Hook
from backends.shadow import shadow_check

#: GLM5_VALIDATE values: "values" runs every value check on every call; "reference" also shadow-checks;
#: "topk" only checks that tensor-parallel ranks agree on each layer's top-k (glm5/parallel/agreement.py)
VALIDATE_MODES = ("", "values", "reference", "topk")


def validation_mode() -> str:
    mode = os.environ.get("GLM5_VALIDATE", "")
    if mode not in VALIDATE_MODES:
        raise ValueError(f"GLM5_VALIDATE: expected one of {VALIDATE_MODES[1:]} or unset, got {mode!r}")
    return mode


class Backend(ContractOps, FP8Ops):  # the typed op methods: backends/contract/typed_ops.py, typed_fp8.py
    name: ClassVar[str] = "?"
    #: torch device type the backend's tensors live on ("cpu", "cuda", "npu").
    device: ClassVar[str] = "cpu"
    #: op name -> implementation; the backend's whole surface.
    ops: ClassVar[Mapping[str, OpImpl]] = {}
    #: ops this backend has not ported and runs on the reference, on host copies (SPEC 3.1); a borrowed op
    #: is served that way even if `ops` has an entry for it (a generated stub). `every_op_except(...)`
    #: (backends/borrow.py) spells "everything but what is ported" during bring-up.
    borrow: ClassVar[frozenset[str]] = frozenset()
    #: how this backend stores the paged MLA latent cache (backends/cache_layout.py): the contract's one
    #: tensor, or split pools its sparse_mla_attention reads with no copy (then its caps list "pools")
    mla_cache: ClassVar[MLACacheLayout] = ONE_TENSOR

    def __init__(self) -> None:
        #: entries into the backend's own implementations (`run`): its native work, also in compiled graphs
        self.calls: Counter[str] = Counter()
        #: op -> its front door (backends/contract/door.py), built on first use
        self._doors = _Doors(self)
        #: front-door hooks, in installation order (backends/hooks.py)
        self._hooks: tuple[Hook, ...] = ()
        self.hooks_busy: set[int] = set()
        #: the ops declared in `borrow`, checked: an unknown name fails here, with the known ones
        self.borrowed: frozenset[str] = check_names(self.borrow, f"{type(self).__name__}.borrow")
        #: calls, bytes each way and seconds of the borrowed ops
        self.borrow_ledger = BorrowLedger()
        self._borrowed_impls: dict[str, OpImpl] = {}
        #: weights an op had to re-lay out per call because they were not `prepare`d (should stay 0)
        self.relayouts: Counter[str] = Counter()
        mode = validation_mode()
        #: every value check on every call (GLM5_VALIDATE=values or =reference)
        self._validate_values = mode in ("values", "reference")
        #: GLM5_VALIDATE=reference: also run the reference on every call and compare (backends/shadow.py)
        self.shadow = mode == "reference" and self.name != "reference"
        #: the name custom ops use to reach this instance (backends/contract/library.py)
        self.key = custom_op.register_instance(self)

    # -- what a backend declares ------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        """(ok, reason): can this backend run on this machine? The reason is shown to users."""
        return True, "ok"

    def impl(self, op: str) -> OpImpl | None:
        """What serves `op`: the reference on host copies if borrowed, else the backend's own table entry
        (None: neither, so calls raise NotSupported)."""
        if op not in self.borrowed:
            return self.ops.get(op)
        impl = self._borrowed_impls.get(op)
        if impl is None:
            impl = borrowed_impl(self.borrow_ledger, op, self.device)
            self._borrowed_impls[op] = impl
        return impl

    def capabilities(self, op: str) -> OpCaps | None:
        impl = self.impl(op)
        return impl.caps if impl else None

    def kernel_calls(self) -> Counter[str]:
        """Native work done so far, keyed by op or kernel family (kernel launches for device backends).
        The conformance runner reads the total before and after each case; no increase means the
        backend's own code did not run. The default counts entries into the backend's implementation
        (borrowed ops are the reference's work, not the backend's: left out)."""
        return Counter({k: n for k, n in self.calls.items() if k.split(".")[0] not in self.borrowed})

    def environment(self) -> dict[str, str]:
        """Versions and device facts for reports."""
        return {"torch": torch.__version__}

    def expectations_path(self) -> Path | None:
        """The backend's conformance expectations manifest (strict xfails and tolerance overrides, each
        with a reason; format in conformance/manifest.py): `expectations.yaml` next to the module that
        defines the backend class. Plugins may override; None means no manifest."""
        mod = sys.modules.get(type(self).__module__)
        file = getattr(mod, "__file__", None)
        return Path(file).with_name("expectations.yaml") if file else None

    def _device_reasons(self, args: Mapping[str, Any]) -> list[str]:
        return device_reasons(self.device, args)

    def reasons(self, op: str, args: Mapping[str, Any], placed: bool = False) -> list[str]:
        """Every reason this backend cannot serve `op` on these (validated) arguments; [] if it can.
        `placed`: the front door has checked the devices already."""
        impl = self.impl(op)
        if impl is None:
            return [f"op {op!r} is not implemented by backend {self.name!r}"]
        misplaced = [] if placed else self._device_reasons(args)
        return caps_reasons(op, OPS[op], impl, args, misplaced)

    @contextlib.contextmanager
    def validating(self, mode: str = "values") -> Iterator[Backend]:
        """Run every value check on every call inside the block (as GLM5_VALIDATE=values does)."""
        if mode != "values":
            raise ValueError(f"mode: expected 'values', got {mode!r}")
        was, self.validate_values = self.validate_values, True
        try:
            yield self
        finally:
            self.validate_values = was

    @contextlib.contextmanager
    def hooked(self, hook: Hook) -> Iterator[Hook]:
        """Install `hook` (backends/hooks.py) on this backend inside the block; blocks nest."""
        self.hooks = (*self.hooks, hook)
        try:
            yield hook
        finally:
            self.hooks = tuple(h for h in self.hooks if h is not hook)

    def with_hooks(self, *hooks: Hook) -> Backend:
        """A view of this backend with `hooks` always installed (after its current ones): the same op
        table, counters and custom-op key, so only the calls made through the view are hooked."""
        view = copy.copy(self)
        view.hooks, view.hooks_busy = (*self.hooks, *hooks), set()  # its own doors
        return view

    # -- weights laid out once -----------------------------------------------------------------------
    def prepare(self, op: str, **weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weight arguments of `op` in this backend's own layout, made once after loading (vllm-ascend's
        `process_weights_after_loading`): e.g. a K-major copy for an operator that wants [K, N].

        A prepared weight keeps the contract's logical shape, dtype and values (only its storage may
        differ: strides, or a derived form the backend keeps beside it), so the front door validates it
        as usual, shadow mode and conformance still compare like with like, and every backend accepts
        every other backend's prepared weights. Identity by default."""
        impl = self.impl(op)
        if impl is None or impl.prepare is None:
            return dict(weights)
        return impl.prepare(dict(weights))

    # -- the front door, built once per op --------------------------------------------------------
    @property
    def hooks(self) -> tuple[Hook, ...]:
        """Front-door hooks, in installation order (backends/hooks.py); setting them rebuilds the doors."""
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: tuple[Hook, ...]) -> None:
        self._hooks = tuple(hooks)
        self._doors = _Doors(self)

    @property
    def validate_values(self) -> bool:
        """Every value check on every call (GLM5_VALIDATE=values or =reference); setting it rebuilds."""
        return self._validate_values

    @validate_values.setter
    def validate_values(self, on: bool) -> None:
        self._validate_values = bool(on)
        self._doors = _Doors(self)

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        """Call `op` with its named arguments through its front door (what `Backend.<op>` does)."""
        return self._doors[op](args)

    def _build_door(self, op: str) -> Callable[[dict[str, Any]], Any]:
        """The front door of `op` on this backend, decided once (backends/contract/door.py); rebuilt when the
        hooks or the validation mode change."""
        return build_door(self, op, own_reasons=type(self).reasons is not Backend.reasons)

    def run_backward(self, op: str, args: dict[str, Any], outputs: tuple, grad_outputs: tuple) -> tuple:
        """The gradients of `op` (one per `OPS[op].grad_args`) from its forward's saved outputs: the
        backend's declared `OpImpl.backward` (called by the op's `<op>_backward` custom op)."""
        self.calls[f"{op}.backward"] += 1
        return self.impl(op).backward(args, outputs, grad_outputs)

    def run(self, op: str, args: dict[str, Any]) -> Any:
        """Run this backend's implementation of `op` on validated arguments (called by the custom op)."""
        self.calls[op] += 1
        impl = self.impl(op)
        result = impl.fn(**args)
        if self.shadow and op not in self.borrowed:  # borrowed: the reference itself
            shadow_check(self.name, op, args, result, impl.caps.tie_rule)
        return result

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.device}>"


class _Doors(dict):
    """op -> the backend's front door for it (backends/contract/door.py), built on first use."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend

    def __missing__(self, op: str) -> Callable[[dict[str, Any]], Any]:
        door = self[op] = self.backend._build_door(op)
        return door


# the typed op methods (the ContractOps and FP8Ops mixins) take exactly each op's declared arguments
check_interface(Backend, OPS)
