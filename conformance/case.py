"""A conformance case: a stable id, a seeded CPU input builder, and how each output is compared.

Cases are generated per op (`conformance/cases/<op>.py`) and per dtype of the op's dtype axis
(`backends.contract.ops.OPS[op].dtype_axis`). The seed of a case is `zlib.crc32("<op>/<case id>")`, so a
subset, a rerun or a parallel run builds bit-identical inputs whatever else is selected.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from backends.cache_layout import MLAPools
from backends.layout import SeqLayout

SUITES = ("smoke", "realistic", "adversarial", "errors", "limits")
#: `--suite` values: which case suites each selects.
SUITE_SETS: dict[str, tuple[str, ...]] = {
    "smoke": ("smoke",),
    "realistic": ("realistic",),
    "adversarial": ("adversarial",),
    "errors": ("errors",),
    # limits/ cases come from each backend's declared bounds (conformance/cases/limits.py); they are in
    # `full`, not `quick`: a bound such as topk <= 8192 is a large input (minutes in Triton's interpreter)
    "limits": ("limits",),
    "quick": ("smoke", "adversarial", "errors"),
    "full": SUITES,
}

Builder = Callable[[torch.Generator, str], dict[str, Any]]


@dataclass(frozen=True)
class Output:
    """One output of an op and the comparator that judges it (`conformance.comparators.COMPARATORS`).
    `params` override the comparator's dtype defaults for this case (SPEC 4 numbers live there)."""

    name: str
    comparator: str
    params: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """op: SPEC op name; id: "<suite>/<name>" (stable: manifests and repro lines use it).

    build(g, dtype) -> keyword arguments of the backend method, CPU tensors.
    outputs: comparators, in the order the op returns its outputs.
    dtypes: the dtypes this case makes sense for (None: the op's whole dtype axis).
    grad_args: arguments whose gradients are compared when the backend claims `differentiable`.
    error: (exception type, message regex) for `errors/` cases.
    trivial: no work to do (empty batch), so a backend may legitimately launch no kernel.
    tags: layout and a shape summary, shown in reports.
    """

    op: str
    id: str
    build: Builder
    outputs: tuple[Output, ...] = ()
    dtypes: tuple[str, ...] | None = None
    grad_args: tuple[str, ...] = ()
    error: tuple[type[BaseException], str] | None = None
    trivial: bool = False
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        suite = self.id.split("/", 1)[0]
        if suite not in SUITES or "/" not in self.id:
            raise ValueError(f"case id: expected '<suite>/<name>' with suite in {SUITES}, got {self.id!r}")
        if (suite == "errors") != (self.error is not None):
            raise ValueError(f"case {self.id!r}: errors/ cases (and only they) give `error`")

    @property
    def suite(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.op}/{self.id}".encode())

    def key(self, dtype: str) -> str:
        """The name manifests and pytest ids match: "op/dtype/suite/name"."""
        return f"{self.op}/{dtype}/{self.id}"

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def inputs(self, dtype: str) -> dict[str, Any]:
        return self.build(self.generator(), dtype)


# -- moving inputs to a backend's device ----------------------------------------------------------


def to_device(value: Any, device: str | torch.device) -> Any:
    """Move one argument, keeping strides: a non-contiguous view stays a non-contiguous view, so a
    backend sees on its device the layout the case built on the CPU."""
    if isinstance(value, SeqLayout):
        return value.to(device)
    if isinstance(value, MLAPools):
        return MLAPools(*(to_device(t, device) for t in value))
    if isinstance(value, torch.Tensor):
        # meta tensors stand for "some other device" in errors/ cases: they stay where they are
        if value.device.type == "meta" or torch.device(device) == value.device:
            return value
        if value.is_contiguous():
            return value.to(device)
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return out.copy_(value)
    return value


def args_to(args: Mapping[str, Any], device: str | torch.device) -> dict[str, Any]:
    return {k: to_device(v, device) for k, v in args.items()}


def clone_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of the tensors (strides kept), so two runs never share storage."""

    def one(v):
        if isinstance(v, torch.Tensor):
            out = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            return out.copy_(v)
        if isinstance(v, MLAPools):
            return MLAPools(*(one(t) for t in v))
        if isinstance(v, SeqLayout):
            return SeqLayout(
                *(
                    None if t is None else t.clone()
                    for t in (v.cu_seqlens_q, v.seqlens_k, v.cu_seqlens_k, v.block_table)
                )
            )
        return v

    return {k: one(v) for k, v in args.items()}


def summarize(args: Mapping[str, Any]) -> str:
    """Shapes, dtypes and contiguity of the inputs, for failure messages."""
    parts = []
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            dt = str(v.dtype).removeprefix("torch.")
            nc = "" if v.is_contiguous() else f", strides={tuple(v.stride())}"
            parts.append(f"{k}=Tensor[{tuple(v.shape)}, {dt}{nc}]")
        elif isinstance(v, SeqLayout):
            h = v.host()
            extra = (
                f"cu_seqlens_k={h['cu_k']}"
                if v.kind == "ragged"
                else f"block_table[{tuple(v.block_table.shape)}]"
            )
            parts.append(f"layout={v.kind}(cu_seqlens_q={h['cu_q']}, seqlens_k={h['seqlens_k']}, {extra})")
        elif isinstance(v, MLAPools):
            shapes = f"latent {tuple(v.latent.shape)}, rope {tuple(v.rope.shape)}"
            parts.append(f"{k}=MLAPools[{shapes}, {v.dtype}]")
        else:
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


def outputs(out: Any) -> tuple:
    """An op's result as a tuple of outputs."""
    return out if isinstance(out, tuple) else (out,)


def host_outputs(out: Any) -> tuple:
    return tuple(o.detach().cpu() if isinstance(o, torch.Tensor) else o for o in outputs(out))


def snapshot(args: Mapping[str, Any]) -> tuple:
    """Host copies of every input tensor, layout metadata included (to catch in-place writes)."""
    out = []
    for v in args.values():
        if isinstance(v, SeqLayout):
            out += [t for t in (v.cu_seqlens_q, v.seqlens_k, v.cu_seqlens_k, v.block_table) if t is not None]
        elif isinstance(v, torch.Tensor) and v.device.type != "meta":
            out.append(v)
        elif isinstance(v, MLAPools):
            out += list(v)
    return tuple(t.detach().to("cpu", copy=True) for t in out)
