"""Input helpers shared by the case generators: seeded tensors, ragged/paged caches whose unused rows
hold NaN, non-contiguous views, near-tie generators, batch-invariance subsets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from backends.layout import SeqLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAN = float("nan")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: what `batch_subset(args)` returns: (arguments of the rows/requests run alone, full outputs -> same rows)
Subset = tuple[dict[str, Any], Callable[[Any], Any]] | None


def tdtype(dtype: str) -> torch.dtype:
    return DTYPES[dtype]


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def randint(g: torch.Generator, lo: int, hi: int, *shape: int, dtype=torch.int64) -> torch.Tensor:
    """Uniform integers in [lo, hi] (inclusive)."""
    return torch.randint(lo, hi + 1, shape, generator=g).to(dtype)


def perm(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=g)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 in the last dim; the gaps hold NaN (never to be read)."""
    fill = NAN if t.dtype.is_floating_point else 0
    base = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype)
    base[..., ::2] = t
    return base[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values, stored with the first two dims swapped (a non-contiguous view)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def near_ties(g: torch.Generator, shape: Sequence[int], dtype: str) -> torch.Tensor:
    """Values with fixed top bits and random low bits (10 for fp32, all mantissa bits below the top 2 for
    16-bit types): dense near-ties and, in 16-bit types, many exact ties."""
    dt = tdtype(dtype)
    base = torch.tensor(1.5, dtype=dt)
    if dt == torch.float32:
        b = base.view(torch.int32)
        low = randint(g, 0, 1023, *shape, dtype=torch.int32)
        return (b & ~1023 | low).view(torch.float32)
    b = base.view(torch.int16)
    nbits = 5 if dt == torch.bfloat16 else 8
    low = randint(g, 0, (1 << nbits) - 1, *shape, dtype=torch.int16)
    return (b & ~((1 << nbits) - 1) | low).view(dt)


def request_lengths(layout: SeqLayout) -> list[tuple[int, int, int]]:
    return layout.request_bounds()


def kv_layout(
    g: torch.Generator,
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    width: int,
    dtype: str,
    *,
    block_size: int | None = None,
    shuffle: bool = True,
    spare_blocks: int = 2,
    gap: int = 3,
    keys: Callable[[int, int], torch.Tensor] | None = None,
) -> tuple[SeqLayout, torch.Tensor]:
    """A layout and a cache of `dtype` holding keys for logical positions 0..k_lens[b]-1 of each request.

    Ragged caches leave `gap` NaN rows before and between requests; paged caches have `spare_blocks`
    unused blocks, NaN tails and (shuffle) block ids in random order. keys(b, n) -> [n, width] float32
    (default: standard normal).
    """
    dt = tdtype(dtype)
    keys = keys or (lambda b, n: randn(g, n, width))
    if block_size is None:
        offs, row = [], gap
        for s in k_lens:
            offs.append(row)
            row += s + gap
        cu_k = torch.tensor(offs + [row - gap], dtype=torch.int32)
        layout = SeqLayout(
            torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32),
            torch.tensor(list(k_lens), dtype=torch.int32),
            cu_seqlens_k=cu_k,
        )
        cache = torch.full((row, width), NAN, dtype=dt)
        for b, s in enumerate(k_lens):
            cache[offs[b] : offs[b] + s] = keys(b, s).to(dt)
        return layout, cache
    need = sum(-(-s // block_size) for s in k_lens)
    nb = need + spare_blocks
    order = perm(g, nb)[:need].tolist() if shuffle else list(range(need))
    layout = SeqLayout.from_lengths(list(q_lens), list(k_lens), block_size=block_size, block_order=order)
    cache = torch.full((nb, block_size, width), NAN, dtype=dt)
    flat = cache.view(-1, width)
    for b, s in enumerate(k_lens):
        if s:
            rows = layout.physical_rows(b, torch.arange(s), cache)
            flat[rows] = keys(b, s).to(dt)
    return layout, cache


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def causal_count(t_b: int, s_b: int, i: int) -> int:
    """Keys query i of a request with t_b queries and s_b keys may see (SPEC 1, right-down)."""
    return max(0, min(s_b, s_b - t_b + i + 1))


def layout_tag(layout: SeqLayout, cache: torch.Tensor) -> str:
    return "ragged" if layout.kind == "ragged" else f"paged_bs{cache.shape[1]}"


# -- batch-invariance subsets --------------------------------------------------------------------


def row_subset(args: dict[str, Any], names: Sequence[str]) -> Subset:
    """The last third of the rows (of every argument in `names`) run alone."""
    n = args[names[0]].shape[0]
    if n < 2:
        return None
    rows = slice(n - max(1, n // 3), n)
    sub = dict(args)
    for k in names:
        if args.get(k) is not None:
            sub[k] = args[k][rows]
    return sub, lambda out: pick_rows(out, lambda t: t[rows])


def request_subset(
    args: dict[str, Any], q_names: Sequence[str], cache_name: str, width_out: bool = False
) -> tuple[dict[str, Any], Callable] | None:
    """The last request with queries, run alone against the same cache (same block table row)."""
    layout: SeqLayout = args["layout"]
    bounds = layout.request_bounds()
    live = [b for b, (q0, q1, _) in enumerate(bounds) if q1 > q0]
    if len(bounds) < 2 or not live:
        return None
    b = live[-1]
    q0, q1, s = bounds[b]
    cu_q = torch.tensor([0, q1 - q0], dtype=torch.int32)
    sk = layout.seqlens_k[b : b + 1].clone()
    if layout.kind == "ragged":
        sub_layout = SeqLayout(cu_q, sk, cu_seqlens_k=layout.cu_seqlens_k[b : b + 2].clone())
    else:
        sub_layout = SeqLayout(cu_q, sk, block_table=layout.block_table[b : b + 1].clone())
    sub = dict(args, layout=sub_layout)
    for k in q_names:
        sub[k] = args[k][q0:q1]
    if width_out:
        return sub, lambda out: pick_rows(out, lambda t: t[q0:q1, :s])
    return sub, lambda out: pick_rows(out, lambda t: t[q0:q1])


def pick_rows(out: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, tuple):
        return tuple(None if t is None else f(t) for t in out)
    return f(out)
