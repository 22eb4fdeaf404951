"""An op's front door on one backend, built once: what every call of `backend.<op>(...)` runs.

`build_door(backend, op)` decides per op, when the door is first used (and again when the backend's hooks
or validation mode change), everything that does not depend on the arguments: which implementation
serves it (own or borrowed), whether value checks run, the out-of-range mapping (SPEC 10), whether hooks
are consulted, whether shadow checks run, the capabilities, and whether the op can take a gradient. The
door then does, per call, only what depends on the arguments:
- validate shapes, dtypes and devices (no host reads); value-check a layout once per `SeqLayout` object
  (every value check on every call when the backend's `validate_values` is on);
- let the hooks (backends/hooks.py) override or observe the call;
- raise `NotSupported` with every reason the capabilities give;
- call the implementation directly when nothing traces and no gradient is wanted (plain eager), else the
  op's custom op `torch.ops.glm5.<op>` (backends/contract/library.py), which compilers, export and autograd
  see.
A plain eager call walks four Python frames from the model's call to the implementation (`Backend.<op>`,
the door, its serve, the implementation; bench/walk_call.py counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from backends.cache_layout import MLAPools, arg_tensors, cache_kind
from backends.caps import OpImpl
from backends.contract import library
from backends.contract.ops import OPS, OpSpec
from backends.errors import NotSupported
from backends.hooks import call_hooked
from backends.layout import SeqLayout
from backends.shadow import shadow_check

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: cache kinds no backward is defined on (split pools; FP8 rows, SPEC 7.9)
INFERENCE_ONLY_KINDS = ("pools", "fp8_ragged", "fp8_paged")


def plain_eager(args: Mapping[str, Any]) -> bool:
    """True when no tracer, mode or subclass would see the op (public torch predicates only): not
    compiling or exporting, no torch dispatch mode active, every tensor a plain tensor or parameter with
    no `__torch_function__` of its own and no torch function mode active. (A functorch transform needs no
    check: `grad` makes the inputs require grad, so the call takes the custom op; vmap has no rule for a
    custom op, so the plain implementation is the one that can run under it.)"""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or is_in_torch_dispatch_mode():
        return False
    tensors = arg_tensors(args)
    layout = args.get("layout")
    if isinstance(layout, SeqLayout):
        tensors += [t for t in layout.tensors() if t is not None]
    return all(type(t) in _PLAIN for t in tensors) and not has_torch_function(tensors)


def device_reasons(device: str, args: Mapping[str, Any]) -> list[str]:
    """The first argument (or split-pool part) not on `device`, as a reason; [] if none."""
    for name, val in args.items():
        parts = val._asdict() if isinstance(val, MLAPools) else {"": val}
        for part, t in parts.items():
            if isinstance(t, torch.Tensor) and t.device.type != device:
                where = f"{name}.{part}" if part else name
                return [f"{where} is on {t.device.type}; this backend runs on {device}"]
    return []


def caps_reasons(op: str, spec: OpSpec, impl: OpImpl, args: Mapping[str, Any], misplaced: list[str]) -> list:
    """Every reason `impl` cannot serve these (validated) arguments of `op` ([] if it can); `misplaced`:
    the device reasons, listed after the dtype and layout ones (limits and checks only when all pass). A
    cache kind with its own kernel (`OpImpl.kinds`, SPEC 7.9) answers with its own caps."""
    out: list[str] = []
    kind = cache_kind(args)
    caps = impl.caps_for(kind)
    dt = spec.dtype_of(args)
    if dt not in caps.dtypes:
        out.append(f"dtype {dt} not in supported {list(caps.dtypes)}")
    if kind is not None and kind not in impl.caps.layouts:
        out.append(f"{kind} cache layout not in supported {list(impl.caps.layouts)}")
    out.extend(misplaced)
    if not out:
        out.extend(caps.limit_reasons(op, args, dt))
    if not out and caps.check is not None:
        out.extend(caps.check(args))
    return out


def _no_grad_reason(op: str, args: Mapping[str, Any], differentiable: bool) -> str:
    kind = cache_kind(args)
    if kind in INFERENCE_ONLY_KINDS:
        return f"{op} on a {kind} cache is inference only (no backward; call it under no_grad)"
    if not differentiable:
        return f"the backward of {op} is not implemented (inputs require grad; call it under no_grad)"
    return ""


def build_door(backend: Any, op: str, own_reasons: bool = False) -> Callable[[dict[str, Any]], Any]:
    """`op`'s front door on `backend` (a `backends.interface.Backend`): a function of the op's named
    arguments returning what `Backend.<op>` returns. See the module docstring. `own_reasons`: the
    backend's class rewrites `reasons` (a test double), so the door asks it rather than the caps."""
    spec = OPS[op]
    name = backend.name
    impl = backend.impl(op)
    validate, values_check = spec.validate, spec.values if backend.validate_values else None
    layout_arg = "layout" if "layout" in spec.arg_names else None
    check_all_layouts, cache_arg = backend.validate_values, spec.cache_arg
    unchecked = spec.unchecked
    device_check = backend._device_reasons
    hooks = backend.hooks

    def check(args: dict[str, Any]) -> bool:
        """Validate; True when the value checks ran (then no out-of-range mapping is needed)."""
        validate(**args)
        misplaced = device_check(args)
        if misplaced:  # before any value check reads a tensor (a meta tensor has no values to read)
            raise NotSupported(misplaced, backend=name, op=op)
        if torch.compiler.is_compiling():  # values cannot be read while tracing
            return False
        if layout_arg is not None:
            layout = args[layout_arg]
            if check_all_layouts or not layout.trusted:
                layout.check(args["q"].shape[0], args[cache_arg], cache_arg)
        if values_check is not None:
            values_check(**args)
            return True
        return False

    serve = _server(backend, op, spec, impl, unchecked, own_reasons)
    if hooks:

        def hooked_door(args: dict[str, Any]) -> Any:
            checked = check(args)
            return call_hooked(backend, op, args, lambda a: serve(a, checked))

        return hooked_door

    def door(args: dict[str, Any]) -> Any:
        return serve(args, check(args))

    return door


def _server(
    backend: Any, op: str, spec: OpSpec, impl: Any, unchecked: Any, own_reasons: bool
) -> Callable[..., Any]:
    """serve(args, values_checked): `op` on validated arguments, past the capabilities, by the plain
    implementation or the custom op."""
    name = backend.name
    if impl is None:
        missing = [f"op {op!r} is not implemented by backend {name!r}"]

        def absent(args: dict[str, Any], checked: bool) -> Any:
            raise NotSupported(missing, backend=name, op=op)

        return absent
    caps, fn, calls, key = impl.caps, impl.fn, backend.calls, backend.key
    grad_args, differentiable = spec.grad_args, caps.differentiable
    forces = impl.backward_forces if impl.backward is not None and impl.backward_forces else None
    returns = spec.returns
    shadow = backend.shadow and op not in backend.borrowed
    tie_rule = caps.tie_rule
    pools_traced = (
        f"{op} on split pools cannot be compiled or exported (no custom op takes two cache tensors); "
        "pass the one-tensor cache there"
    )
    custom = library.CUSTOM_OPS[op]
    flatten = spec.flatten

    def serve(args: dict[str, Any], checked: bool) -> Any:
        finish = None
        if unchecked is not None and not checked:
            # values not checked: out-of-range ones get the one defined result of SPEC 10 on every backend
            args, finish = unchecked(args)
        why = (
            backend.reasons(op, args, placed=True) if own_reasons else caps_reasons(op, spec, impl, args, [])
        )
        if why:
            raise NotSupported(why, backend=name, op=op)
        grad_on = torch.is_grad_enabled()
        wants_grad = grad_on and any(
            isinstance(args[n], torch.Tensor) and args[n].requires_grad for n in grad_args
        )
        if wants_grad:
            why_not = _no_grad_reason(op, args, differentiable)
            if why_not:
                raise NotSupported([why_not], backend=name, op=op)
        else:
            if grad_on:  # the op has no backward here: its outputs carry no gradient, on either path
                args = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            pools = isinstance(args.get("kv_cache"), MLAPools)
            if pools and (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
                raise NotSupported([pools_traced], backend=name, op=op)
            if pools or plain_eager(args):
                # nothing traces and no gradient is wanted: the custom op would only add its dispatch
                # cost (about 15 us a call) to the same implementation. Split pools (two tensors where
                # the custom op takes one cache tensor) are always served here: under a dispatch or
                # function mode the mode sees the implementation's own ops
                calls[op] += 1
                out = fn(**args)
                if shadow:
                    shadow_check(name, op, args, out, tie_rule)
                if returns is not None:
                    out = returns(args, out)
                return out if finish is None else finish(out)
        asked = args if forces is None or not wants_grad else {**args, **forces}
        out = custom(*flatten(asked), key)
        if returns is not None:
            out = returns(args, out)
        return out if finish is None else finish(out)

    return serve
