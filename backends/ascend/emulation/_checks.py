"""Argument checks shared by the operator emulations: they raise what the real operator raises for
inputs its documentation excludes (aclnn parameter checks surface as RuntimeError in torch_npu)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class OperatorRejected(RuntimeError):
    """The emulated operator refuses these arguments, as the real one documents it would."""


class NotEmulated(NotImplementedError):
    """A documented operator feature this emulation does not model (the backend does not use it)."""


def reject(op: str, arg: str, expected: str, got: object) -> None:
    raise OperatorRejected(f"{op}: {arg}: expected {expected}, got {got}")


def need(cond: bool, op: str, arg: str, expected: str, got: object) -> None:
    if not cond:
        reject(op, arg, expected, got)


def need_dtype(op: str, arg: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    need(
        t.dtype in allowed,
        op,
        arg,
        "dtype in " + "/".join(str(d).removeprefix("torch.") for d in allowed),
        t.dtype,
    )


def need_int32_vector(op: str, arg: str, t: object, length: int | None = None) -> torch.Tensor:
    need(isinstance(t, torch.Tensor), op, arg, "an int32 tensor", type(t).__name__)
    need(t.dtype == torch.int32 and t.dim() == 1, op, arg, "int32 [B]", f"{t.dtype} {list(t.shape)}")
    if length is not None:
        need(t.shape[0] == length, op, arg, f"length {length}", t.shape[0])
    return t


def cumulative_bounds(op: str, arg: str, cum: list[int], total: int) -> list[tuple[int, int]]:
    """Segments [start, end) from prefix sums (TND convention: entry b is the end of segment b)."""
    need(
        all(b >= a for a, b in zip([0] + cum, cum, strict=False)),
        op,
        arg,
        "non-decreasing prefix sums (TND is cumulative)",
        cum,
    )
    need(not cum or cum[-1] <= total, op, arg, f"prefix sums ending at <= {total} rows", cum)
    return list(zip([0] + cum[:-1], cum, strict=True))


def need_pa_bsnd(op: str, key: torch.Tensor, d: int) -> int:
    """A PA_BSND paged key cache [blocks, block_size, 1, d] with a documented block size; returns it."""
    from backends.ascend._soc import BLOCK_MULTIPLE, MAX_BLOCK

    need(
        key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == d,
        op,
        "key",
        f"PA_BSND [blocks, block_size, 1, {d}]",
        list(key.shape),
    )
    bs = key.shape[1]
    need(
        bs % BLOCK_MULTIPLE == 0 and 0 < bs <= MAX_BLOCK,
        op,
        "key",
        f"block_size a multiple of {BLOCK_MULTIPLE}, <= {MAX_BLOCK}",
        bs,
    )
    return bs
