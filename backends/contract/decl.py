"""One declaration per op (`OpDecl`, in the spirit of vLLM IR's `register_op` and PyTorch's `OpInfo`).

Each op of the contract is declared once, in its reference module `backends/reference/<op>.py` (`DECL`;
the reference function is the signature; what several declarations share: `backends/reference/_common.py`;
the validators' vocabulary: `backends/argcheck.py`): its typed signature, its fake (output shapes and dtypes),
which arguments gradients flow to, its dtype axis, validators, limit quantities, a small sample-input
generator, how it sees a sharded model (SPEC 11) and its spec section. Everything else is derived from
that table:
- `backends.contract.ops.OPS` (the op table the front door and the conformance matrix read) is the table
itself;
- `backends.contract.limits.QUANTITIES` is each declaration's `quantities`;
- the custom op `torch.ops.glm5.<op>`, its fake, its autograd and its `<op>_backward` op
  (backends/contract/torch_op.py), with the schema generated from the signature here;
- opcheck's samples and each op's first conformance smoke case (`decl/sample`);
- the typed `Backend.<op>` methods stay hand-written (users get IDE help) and are checked against the
  signature at import (`check_interface`), as every backend's implementation is (backends/contract/table.py).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from backends.layout import SeqLayout

NO_DEFAULT = inspect.Parameter.empty

#: Python type of a declared argument -> its custom-op schema type (a SeqLayout is flattened: LAYOUT)
SCHEMA_TYPES: dict[Any, str] = {
    torch.Tensor: "Tensor",
    int: "SymInt",
    float: "float",
    bool: "bool",
    torch.dtype: "ScalarType",
}
#: a SeqLayout crosses the op boundary as its tensors plus max_seqlen_k (-1: unknown)
LAYOUT: tuple[tuple[str, str], ...] = (
    ("cu_seqlens_q", "Tensor"),
    ("seqlens_k", "Tensor"),
    ("cu_seqlens_k", "Tensor?"),
    ("block_table", "Tensor?"),
    ("max_seqlen_k", "SymInt"),
)
_LAYOUT_NAMES = tuple(n for n, _ in LAYOUT)
#: how a sharded model calls an op (SPEC 11): the vocabulary of `OpDecl.sharding`
SHARDING = ("replicated", "heads local", "experts or intermediate local", "columns or rows local", "unsplit")


@dataclass(frozen=True)
class Param:
    """One argument of an op: name, schema type ("SeqLayout" for a layout), default."""

    name: str
    schema: str
    default: Any = NO_DEFAULT

    @property
    def is_tensor(self) -> bool:
        return self.schema.startswith("Tensor")


def _schema_type(name: str, hint: Any) -> str:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(rest) < len(typing.get_args(hint))
        hint = rest[0] if len(rest) == 1 else hint
    if hint is SeqLayout and not optional:
        return "SeqLayout"
    base = SCHEMA_TYPES.get(hint)
    if base is None:
        raise TypeError(
            f"argument {name!r}: type {hint!r} has no custom-op schema type ({list(SCHEMA_TYPES)})"
        )
    return base + ("?" if optional else "")


def _outputs(hint: Any) -> int:
    if typing.get_origin(hint) is tuple:
        return len(typing.get_args(hint))
    return 1


@dataclass(frozen=True)
class OpDecl:
    """Everything the contract says about one op (SPEC 2 / 7); see the module docstring.

    signature: a stub whose typed parameters and defaults are the op's (its docstring: the op's summary).
    fake(args) -> the outputs' shapes and dtypes as empty tensors, from the interface's named arguments
      (None for an output the arguments did not ask for: the custom op returns an empty [0] fp32 for it).
    sample(g, dtype, grad) -> small, realistic named arguments of the dtype-axis value (grad: the
      grad_args require grad).
    sharding: how a sharded model calls it (SPEC 11; one of SHARDING).
    grad_args: arguments gradients flow to where a backend declares the op differentiable; saves_outputs:
      the backward reads the forward's outputs; nondiff_outputs: outputs that carry no gradient.
    returns(args, outputs): the interface's result from the custom op's (None: the same).
    before_backward(run, args, outputs, grads) -> (args, outputs, grads): what the backward op adjusts
      first (run(args): one more forward).
    """

    name: str
    spec_section: str
    signature: Callable[..., Any]
    dtype_axis: tuple[str, ...]
    dtype_of: Callable[[dict[str, Any]], str]
    validate: Callable[..., Any]  # shapes, dtypes, devices: every call, no host reads
    fake: Callable[[dict[str, Any]], Any]
    sample: Callable[[torch.Generator, str, bool], dict[str, Any]]
    sharding: str
    values: Callable[..., Any] | None = None  # value checks: once per layout, or per call in values mode
    cache_arg: str | None = None  # the argument indexed through a SeqLayout, if any
    grad_args: tuple[str, ...] = ()
    outputs: int | None = None  # the custom op's outputs where they are more than the signature returns
    saves_outputs: bool = False
    nondiff_outputs: tuple[int, ...] = ()
    #: quantity -> how to measure it on the interface's arguments (no host reads; None: unknown)
    quantities: Mapping[str, Callable[[dict[str, Any]], int | None]] = field(default_factory=dict)
    #: sized(g, dtype, quantity, value) -> arguments with that quantity at value (limit cases, SPEC 3)
    sized: Callable[[torch.Generator, str, str, int], dict[str, Any]] | None = None
    returns: Callable[[dict[str, Any], Any], Any] | None = None
    #: unchecked(args) -> (args, finish or None): where the value checks do not run, out-of-range values
    #: mapped on the device to the one result SPEC 10 defines (finish(out) fixes the result up)
    unchecked: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]] | None = None
    before_backward: Callable[..., tuple] | None = None
    params: tuple[Param, ...] = field(init=False)
    num_outputs: int = field(init=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(self.signature)
        sig = inspect.signature(self.signature)
        params = tuple(Param(n, _schema_type(n, hints[n]), p.default) for n, p in sig.parameters.items())
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "num_outputs", self.outputs or _outputs(hints.get("return")))
        names = {p.name for p in params}
        if self.grad_args != tuple(p.name for p in params if p.name in self.grad_args):
            raise ValueError(f"{self.name}: grad_args {self.grad_args} not in the signature's order")
        for n in self.grad_args:
            if n not in names or not next(p for p in params if p.name == n).is_tensor:
                raise ValueError(f"{self.name}: grad_args {n!r} is not a tensor argument of {sorted(names)}")
        if self.sharding not in SHARDING:
            raise ValueError(f"{self.name}: sharding {self.sharding!r}, expected one of {SHARDING}")
        if self.cache_arg is not None and self.cache_arg not in names:
            raise ValueError(f"{self.name}: cache_arg {self.cache_arg!r} is not an argument")

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    # -- the custom op's flat arguments (schema order, checked by name) -----------------------------
    def flat_params(self) -> tuple[tuple[str, str], ...]:
        """(name, schema type) of the custom op's arguments, a layout flattened in place, without the
        backend key."""
        out: list[tuple[str, str]] = []
        for p in self.params:
            out.extend(LAYOUT if p.schema == "SeqLayout" else ((p.name, p.schema),))
        return tuple(out)

    def schema(self) -> str:
        args = ", ".join(f"{t} {n}" for n, t in self.flat_params())
        outs = "Tensor" if self.num_outputs == 1 else "(" + ", ".join(["Tensor"] * self.num_outputs) + ")"
        return f"({args}, str backend) -> {outs}"

    def flatten(self, args: Mapping[str, Any]) -> tuple:
        """The custom op's positional arguments (without the key) from the interface's named ones, by
        name in the declared order (a missing or unknown name is a TypeError, whatever the dict order)."""
        if set(args) != set(self.arg_names):
            raise TypeError(f"{self.name}: expected arguments {self.arg_names}, got {tuple(args)}")
        flat: list[Any] = []
        for p in self.params:
            v = args[p.name]
            if p.schema == "SeqLayout":
                flat.extend((*v.tensors(), -1 if v.max_seqlen_k is None else v.max_seqlen_k))
            else:
                flat.append(v)
        return tuple(flat)

    def unflatten(self, flat: tuple, fake: bool = False) -> dict[str, Any]:
        """The interface's named arguments from the custom op's (a layout rebuilt as trusted; for a fake,
        a plain namespace of its fields: while tracing, max_seqlen_k may be symbolic)."""
        out: dict[str, Any] = {}
        i = 0
        for p in self.params:
            if p.schema == "SeqLayout":
                cu_q, sk, cu_k, bt, max_k = flat[i : i + 5]
                fields = (cu_q, sk, cu_k, bt, max_k if max_k >= 0 else None)
                out[p.name] = (
                    SimpleNamespace(**dict(zip(_LAYOUT_NAMES, fields, strict=True)))
                    if fake
                    else (SeqLayout(*fields, trusted=True))
                )
                i += 5
            else:
                out[p.name] = flat[i]
                i += 1
        return out

    def as_asked(self, args: dict[str, Any], outputs: Any) -> Any:
        return outputs if self.returns is None else self.returns(args, outputs)


def check_interface(cls: type, decls: Mapping[str, OpDecl]) -> None:
    """Raise TypeError unless `cls.<op>` takes each declared op's arguments: names, order, types and
    defaults (the typed interface and the declaration may not drift)."""
    for op, d in decls.items():
        method = getattr(cls, op, None)
        if method is None:
            raise TypeError(f"{cls.__name__} has no method for the declared op {op!r}")
        want_hints, got_hints = typing.get_type_hints(d.signature), typing.get_type_hints(method)
        want = [(n, want_hints[n], p.default) for n, p in inspect.signature(d.signature).parameters.items()]
        got = [
            (n, got_hints.get(n), p.default)
            for n, p in inspect.signature(method).parameters.items()
            if n != "self"
        ]
        if got != want:
            raise TypeError(
                f"{cls.__name__}.{op} takes {got}; its declaration ({d.signature.__module__}) {want}"
            )
