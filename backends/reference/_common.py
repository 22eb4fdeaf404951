"""What several declarations share: the dtype axes, dtype-of rules, fakes, quantities and sample pieces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.layout import SeqLayout

FLOATS = ("float32", "bfloat16", "float16")
FP8 = ("float8_e4m3fn",)
E4M3 = torch.float8_e4m3fn


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_of(arg: str) -> Callable[[dict[str, Any]], str]:
    """The dtype-axis value of a call: the dtype of tensor `arg` (or `arg` itself when it is a dtype)."""

    def of(a: dict[str, Any]) -> str:
        v = a[arg]
        return dtype_name(v if isinstance(v, torch.dtype) else v.dtype)

    return of


def dim(name: str, d: int) -> Callable[[dict[str, Any]], int]:
    return lambda a: a[name].shape[d]


def scalar(name: str) -> Callable[[dict[str, Any]], int]:
    return lambda a: a[name]


def max_keys(a: dict[str, Any]) -> int | None:
    return a["layout"].max_seqlen_k  # the host int the layout carries (None: unknown, not checked)


def attention_fake(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, h, _ = a["q"].shape
    lse = a["q"].new_empty((t, h), dtype=torch.float32) if a["return_lse"] else None
    return a["q"].new_empty((t, h, a["d_v"])), lse


def attention_returns(a: dict[str, Any], out: tuple) -> tuple:
    """lse is None unless asked for (the custom op returns an empty [0] in its place)."""
    return out if a.get("return_lse", True) else (out[0], None)


def rows_by_cols(rows: tuple[str, int], cols: tuple[str, int], dtype: Callable) -> Callable:
    """A fake [args[rows][d], args[cols][d']] of dtype(args)."""
    return lambda a: a[rows[0]].new_empty(
        (a[rows[0]].shape[rows[1]], a[cols[0]].shape[cols[1]]), dtype=dtype(a)
    )


# -- sample pieces: small tensors, more keys than topk (2048: below it DSA equals dense attention) -----
TDTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def randn(g: torch.Generator, *shape: int, dtype: str = "float32", grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(TDTYPE.get(dtype, torch.float32)).requires_grad_(grad)


def int8(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


def long_layout() -> SeqLayout:
    """Two requests (3 and 1 queries) over 2100 and 2500 keys, paged 64 a block in reverse block order."""
    return SeqLayout.from_lengths([3, 1], [2100, 2500], block_size=64, block_order=list(range(80))[::-1])


LONG_BLOCKS = 80
