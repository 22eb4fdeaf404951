"""How a backend stores the paged MLA latent cache (SPEC 2.4): one tensor, or two pools.

The contract's paged latent cache is one tensor `[num_blocks, block_size, c + r]`, each row
`[c_kv ; k_pe]`. A backend whose attention reads the two halves from separate contiguous pools
(Ascend's `npu_sparse_flash_attention` in PA_BSND: latent `[blocks, 128, 1, 512]`, rope
`[blocks, 128, 1, 64]`) declares `MLACacheLayout(split=(512, 64), block_size=128)` as its
`Backend.mla_cache`; whoever allocates caches (glm5/core/cache.py, the vLLM plugin) then hands its
`sparse_mla_attention` an `MLAPools` pair, and the backend reads it with no per-call copy.

The pools are one buffer reinterpreted, not two allocations: the first `num_blocks * block_size * c`
elements are the latent pool, the rest the rope pool. So the bytes per block (vLLM's page size) are the
one-tensor cache's, and a cache engine that allocates one buffer per layer needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class MLAPools(NamedTuple):
    """The paged MLA latent cache as two pools, one KV head (PA_BSND): `latent [nb, bs, 1, c]` and
    `rope [nb, bs, 1, r]`. Key p of a block is `cat(latent[blk, p, 0], rope[blk, p, 0])`.

    It answers `shape`, `dim()`, `dtype` and `device` as the one-tensor paged cache `[nb, bs, c + r]` it
    stands for, so layout checks and block arithmetic read it unchanged."""

    latent: torch.Tensor
    rope: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        nb, bs = self.latent.shape[:2]
        return torch.Size((nb, bs, self.latent.shape[-1] + self.rope.shape[-1]))

    def dim(self) -> int:
        return 3

    @property
    def dtype(self) -> torch.dtype:
        return self.latent.dtype

    @property
    def device(self) -> torch.device:
        return self.latent.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latent, self.rope

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Physical rows (block * block_size + offset, int64 [n]) -> [n, c + r]; copies only those rows."""
        lat = self.latent.reshape(-1, self.latent.shape[-1]).index_select(0, rows)
        rope = self.rope.reshape(-1, self.rope.shape[-1]).index_select(0, rows)
        return torch.cat([lat, rope], dim=-1)

    def joined(self) -> torch.Tensor:
        """The one-tensor cache `[nb, bs, c + r]` (a copy of both pools: for adapters that need it)."""
        nb, bs, d = self.shape
        return self.rows(torch.arange(nb * bs, device=self.device)).view(nb, bs, d)

    @staticmethod
    def of(buffer: torch.Tensor, latent_width: int) -> MLAPools:
        """A contiguous buffer of a one-tensor cache `[nb, bs, c + r]` reinterpreted, with no copy, as two
        contiguous pools (the latent pool first, then the rope pool; rows are not preserved)."""
        if buffer.dim() != 3 or not buffer.is_contiguous():
            raise ValueError(
                f"buffer: expected a contiguous [num_blocks, block_size, D] tensor, got shape "
                f"{tuple(buffer.shape)} strides {buffer.stride()}"
            )
        nb, bs, d = buffer.shape
        if not 0 < latent_width < d:
            raise ValueError(f"latent_width: expected in (0, {d}), got {latent_width}")
        flat = buffer.view(-1)
        cut = nb * bs * latent_width
        return MLAPools(
            flat[:cut].view(nb, bs, 1, latent_width), flat[cut:].view(nb, bs, 1, d - latent_width)
        )


MLACache = torch.Tensor | MLAPools


@dataclass(frozen=True)
class MLACacheLayout:
    """A backend's paged MLA latent cache. `split`: (latent width, rope width) of two pools, or None for
    the contract's one tensor. `block_size`: the block size the split pools need (None: any).

    The split applies to a paged cache whose row is exactly `sum(split)` wide and whose block size is
    the required one; any other cache (ragged, another width or block size, FP8's 656-byte rows) stays
    one tensor, which every backend also reads (by its copying route)."""

    split: tuple[int, int] | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.split is not None and (
            len(self.split) != 2 or any(not isinstance(w, int) or w < 1 for w in self.split)
        ):
            raise ValueError(f"split: expected (latent width, rope width), positive ints, got {self.split!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size: expected a positive int or None, got {self.block_size!r}")

    def splits(self, block_size: int | None, width: int, dtype: torch.dtype) -> bool:
        """Whether a paged cache of this block size (None: ragged), row width and dtype is split."""
        return (
            self.split is not None
            and block_size is not None
            and dtype.is_floating_point
            and dtype.itemsize > 1  # FP8 caches keep their 656-byte rows (SPEC 7.6)
            and width == sum(self.split)
            and self.block_size in (None, block_size)
        )

    def required_block_size(self, width: int, dtype: torch.dtype) -> int | None:
        """The block size a paged cache of this row width and dtype must have to be stored as the split
        pools (what a cache allocator such as the vLLM plugin sets); None when any block size serves or
        such a cache is never split."""
        if self.block_size is None or not self.splits(self.block_size, width, dtype):
            return None
        return self.block_size

    def shapes(self, num_blocks: int, block_size: int, width: int) -> tuple[tuple[int, ...], ...]:
        """The tensors of a paged cache as this backend stores it: one `(nb, bs, width)` or two pools."""
        if not self.splits(block_size, width, torch.bfloat16):
            return ((num_blocks, block_size, width),)
        return tuple((num_blocks, block_size, 1, w) for w in self.split)

    def view(self, buffer: torch.Tensor, block_size: int | None) -> MLACache:
        """A freshly allocated one-tensor cache buffer as this backend stores it (no copy)."""
        if not self.splits(block_size, buffer.shape[-1], buffer.dtype):
            return buffer
        return MLAPools.of(buffer, self.split[0])


#: the contract's one-tensor cache (every backend's default)
ONE_TENSOR = MLACacheLayout()


def write_rows(cache: MLACache, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Write values [T, D] at physical rows (int64 [T]) of a one-tensor cache or of both pools."""
    if isinstance(cache, MLAPools):
        c = cache.latent.shape[-1]
        cache.latent.view(-1, c).index_copy_(0, rows, values[:, :c].to(cache.dtype))
        cache.rope.view(-1, cache.rope.shape[-1]).index_copy_(0, rows, values[:, c:].to(cache.dtype))
        return
    cache.view(-1, cache.shape[-1]).index_copy_(0, rows, values.to(cache.dtype))


#: FP8 rows (uint8): FlashMLA's 656-byte latent rows, or the FP8 indexer cache (keys e4m3 + fp32 scales)
FP8_KINDS = ("fp8_ragged", "fp8_paged")
#: the arguments a cache is passed in (sparse attention's latent cache, the indexer's key cache)
CACHE_ARGS = ("kv_cache", "k_cache")


def cache_kind(args: dict) -> str | None:
    """The cache kind of an attention-like op's arguments (None: no layout): "ragged" / "paged" (one
    tensor of the op's dtype), "pools" (split pools, `MLAPools`), "fp8_ragged" / "fp8_paged" (a uint8
    cache of FP8 rows, SPEC 7.8)."""
    layout = args.get("layout")
    kind = getattr(layout, "kind", None)
    if kind is None:
        return None
    for name in CACHE_ARGS:
        cache = args.get(name)
        if isinstance(cache, MLAPools):
            return "pools"
        if cache is not None and cache.dtype == torch.uint8:
            return f"fp8_{kind}"
    return kind


def arg_tensors(args: dict) -> list[torch.Tensor]:
    """The tensors among the arguments, a split-pool cache's two pools included."""
    out: list[torch.Tensor] = []
    for v in args.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, MLAPools):
            out.extend(v.tensors())
    return out
