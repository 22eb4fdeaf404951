"""Argument checks every validator builds on: a `ValueError` naming the argument, the expected and the
actual value (SPEC 2). No tensor values are read here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fail(arg: str, expected: object, actual: object) -> NoReturn:
    raise ValueError(f"{arg}: expected {expected}, got {actual}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument; `None` in `shape` matches any size."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else "one of " + ", ".join(str(d) for d in allowed)
            fail(name, f"dtype {want}", t.dtype)
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_nd:
            fail(name, f"{' or '.join(str(n) for n in allowed_nd)} dims", f"shape {_shape(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            fail(name, f"shape {want}", f"shape {_shape(t)}")
    if device is not None and t.device != device:
        fail(name, f"device {device}", t.device)
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    for n, t in items:  # a list or a number where a tensor belongs: the same ValueError on every backend
        if not isinstance(t, torch.Tensor):
            fail(n, "a torch.Tensor", type(t).__name__)
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            fail(n, f"device {first.device} (as {first_name})", t.device)


def check_int(name: str, v: object, *, min_value: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(name, "an int", type(v).__name__)
    if min_value is not None and v < min_value:
        fail(name, f"an int >= {min_value}", v)
    return v
