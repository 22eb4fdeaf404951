"""Inputs with one quantity of an op at a given value: each declaration's `sized` (backends/decl.py), from
which the conformance suite builds a case at each declared limit and one just past it
(conformance/cases/limits.py). Each builder makes the smallest valid arguments with that quantity set;
attention and indexer inputs keep more keys than topk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.decls._common import FLOATS
from backends.layout import SeqLayout

KEYS = 2100  # > 2048: below it sparse attention equals dense and hides bugs


def _f(g: torch.Generator, dtype: str, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(getattr(torch, dtype))


def _attention(q: str, v: int) -> Callable:
    def build(g, dt):
        h = v if q == "heads" else 2
        d_v = v if q == "d_v" else 32
        d_qk = v if q == "d_qk" else (d_v + v if q == "d_qk_minus_d_v" else max(d_v + 8, 40))
        d_v = min(d_v, d_qk)
        topk = v if q == "topk" else 2048
        keys = max(KEYS, topk + 5)
        lay = SeqLayout.from_lengths([2], [keys], block_size=64)
        idx = torch.randint(-1, keys, (2, topk), generator=g, dtype=torch.int32)
        kv = _f(g, dt, -(-keys // 64), 64, d_qk)
        return dict(
            q=_f(g, dt, 2, h, d_qk), kv_cache=kv, indices=idx, layout=lay, sm_scale=d_qk**-0.5, d_v=d_v
        )

    return build


def _fp8_attention(q: str, v: int) -> Callable:
    """The 656-byte cache fixes d_qk 576 and d_v 512: heads and topk are what vary."""

    def build(g, dt):
        from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant

        h = v if q == "heads" else 2
        topk = v if q == "topk" else 2048
        keys = max(KEYS, topk + 5)
        lay = SeqLayout.from_lengths([2], [keys], block_size=64)
        rows = fp8_mla_cache_quant(torch.randn(-(-keys // 64) * 64, 576, generator=g) / 10)
        idx = torch.randint(-1, keys, (2, topk), generator=g, dtype=torch.int32)
        return dict(
            q=_f(g, dt, 2, h, 576),
            kv_cache=rows.reshape(-1, 64, 656),
            indices=idx,
            layout=lay,
            sm_scale=576**-0.5,
            d_v=512,
            return_lse=True,
        )

    return build


Sized = Callable[[torch.Generator, str, str, int], dict[str, Any]]


def _float(dt: str) -> str:
    """The float dtype a dtype-axis value builds its float tensors in (W8A8 / W4A8 / FP8: float32)."""
    return dt if dt in FLOATS else "float32"


def attention(g: torch.Generator, dt: str, q: str, v: int) -> dict[str, Any]:
    return _attention(q, v)(g, _float(dt))


def fp8_attention(g: torch.Generator, dt: str, q: str, v: int) -> dict[str, Any]:
    return _fp8_attention(q, v)(g, _float(dt))
