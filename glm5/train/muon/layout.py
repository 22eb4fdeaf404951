"""Where each rank's part of a Muon parameter lies (the Layouts glm5/train/muon/sharded.py plans its traffic
with): FSDP2 chunks, the parallel plan's slices, both on a 2-D mesh; the Muon block categories, the
Newton-Schulz cost and the owner assignment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from glm5.parallel.layout import WHOLE, ParamLayout
from glm5.train.muon.optimizer import Blocks

CATEGORIES = ("per-head", "per-expert", "matrix")
SCHEMES = ("naive", "owner", "split")


# -- where a shard lies --------------------------------------------------------------------------------
def chunk_ranges(n: int, world: int) -> tuple[tuple[int, int], ...]:
    """(start, length) of each rank's part of n rows, as torch.chunk (and so FSDP2) splits them."""
    size = -(-n // world) if n else 0
    return tuple((min(r * size, n), max(0, min(size, n - r * size))) for r in range(world))


@dataclass(frozen=True)
class Layout:
    """How one Muon parameter is split: along `dim` of `full_shape`, rank r holding `ranges[r]`
    (start, length), in process group `group` (None: the default group); with `dim2`, also along that
    dim, rank r holding `ranges2[r]` of it (a 2-D mesh's box)."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]
    rank: int
    group: dist.ProcessGroup | None = field(default=None, compare=False)
    dim2: int | None = None
    ranges2: tuple[tuple[int, int], ...] | None = None

    @property
    def world(self) -> int:
        return len(self.ranges)

    def shape(self, r: int) -> list[int]:
        """The shape of rank r's part."""
        shape = list(self.full_shape)
        shape[self.dim] = self.ranges[r][1]
        if self.dim2 is not None:
            shape[self.dim2] = self.ranges2[r][1]
        return shape

    def box(self, r: int) -> tuple[slice, ...]:
        """Rank r's part of the full tensor, one slice per dim."""
        out = [slice(None)] * len(self.full_shape)
        start, n = self.ranges[r]
        out[self.dim] = slice(start, start + n)
        if self.dim2 is not None:
            start, n = self.ranges2[r]
            out[self.dim2] = slice(start, start + n)
        return tuple(out)

    def local_blocks(self, blk: Blocks) -> Blocks | None:
        """The Blocks of this rank's shard when every rank's shard holds whole blocks, else None."""
        if self.world == 1:
            return blk
        if self.dim != 0 or self.dim2 is not None:
            return None
        rows_per_index = math.prod(self.full_shape[1:-1])  # 1 for a matrix, r for stacked [E, r, c]
        unit = sum(blk.sections)
        if any((s * rows_per_index) % unit or (n * rows_per_index) % unit for s, n in self.ranges):
            return None
        return Blocks(self.ranges[self.rank][1] * rows_per_index // unit, blk.sections)

    def padded_numel(self) -> int:
        """Elements of the largest shard: what each rank sends on the owner path."""
        return max(math.prod(self.shape(r)) for r in range(self.world))


def category(blk: Blocks, full_shape: Sequence[int]) -> str:
    if len(full_shape) == 3:
        return "per-expert"
    return "per-head" if blk.heads > 1 else "matrix"


def ns_cost(blk: Blocks, cols: int) -> int:
    """Newton-Schulz cost of a Muon parameter, ~ heads * m * n * min(m, n) per section."""
    return sum(blk.heads * rows * cols * min(rows, cols) for rows in blk.sections)


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """Greedy largest-first: each matrix, most expensive first, to the least-loaded rank (lowest on a tie).
    The same costs give the same owners on every rank."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def process_group_of(group) -> dist.ProcessGroup | None:
    """A glm5.parallel Group (TorchGroup carries `.group`) or a ProcessGroup -> the ProcessGroup."""
    return getattr(group, "group", group)


def _grid(dp_ranks: list[int], model_ranks: list[int]) -> dict[int, tuple[int, int]]:
    """Global rank -> (dp rank, tp / ep rank) on a 2-D mesh, from this rank's dp group (its column) and
    tp / ep group (its row): a regular grid, rank = column[d] + row[t] - this rank."""
    me = set(dp_ranks) & set(model_ranks)
    if len(me) != 1:
        raise ValueError(f"groups: a dp group {dp_ranks} and a model group {model_ranks} do not cross once")
    (me_rank,) = me
    return {
        dp_ranks[d] + model_ranks[t] - me_rank: (d, t)
        for d in range(len(dp_ranks))
        for t in range(len(model_ranks))
    }


def _layout_2d(p: DTensor, mesh, i: int, place: ParamLayout) -> Layout | None:
    """A plan slice or a plan-replicated parameter that FSDP2 sharded over the dp ranks: its Layout over
    every rank of the 2-D mesh (the default group), or None when the plan neither split nor copied it."""
    info, copies = place.shard, place.copies
    if info is None and copies is None:
        return None
    model_pg = process_group_of(info.group if info is not None else copies)
    grid = _grid(mesh.mesh.tolist(), dist.get_process_group_ranks(model_pg))
    world = dist.get_world_size()
    if sorted(grid) != list(range(world)):
        raise ValueError(f"mesh: the dp x model grid {sorted(grid)} does not cover the {world} ranks")
    rows = chunk_ranges(p.shape[0], mesh.size(i))  # FSDP2's chunks of the local (slice) rows
    if info is None:
        full, ranges, dim2, ranges2 = tuple(p.shape), [rows[grid[g][0]] for g in range(world)], None, None
    else:
        full, n = tuple(info.full_shape), info.full_shape[info.dim] // info.size
        if info.dim == 0:  # the plan's slice, then FSDP's chunk of it
            ranges = [(grid[g][1] * n + rows[grid[g][0]][0], rows[grid[g][0]][1]) for g in range(world)]
            dim2, ranges2 = None, None
        else:
            ranges = [rows[grid[g][0]] for g in range(world)]
            dim2, ranges2 = info.dim, tuple((grid[g][1] * n, n) for g in range(world))
    return Layout(full, 0, tuple(ranges), dist.get_rank(), None, dim2, ranges2)


def layout_of(p: torch.Tensor, place: ParamLayout = WHOLE) -> Layout | None:
    """The Layout of a sharded parameter: an FSDP2 / DTensor `Shard(0)` over one mesh dimension (others
    replicated), or the plan's slice of it (`place`, its entry in the plan's table), or both on a 2-D mesh
    (module docstring); None when replicated."""
    if isinstance(p, DTensor):
        sharded = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
        if not sharded:
            return None
        pl = p.placements[sharded[0]]
        if len(sharded) > 1 or not isinstance(pl, Shard) or pl.dim != 0:
            raise ValueError(
                f"placements: expected Shard(0) on one mesh dimension, got {p.placements} "
                f"(a parameter of shape {tuple(p.shape)})"
            )
        mesh, i = p.device_mesh, sharded[0]
        two_d = _layout_2d(p, mesh, i, place)
        if two_d is not None:
            return two_d
        ranges = chunk_ranges(p.shape[0], mesh.size(i))
        return Layout(tuple(p.shape), 0, ranges, mesh.get_local_rank(i), mesh.get_group(i))
    info = place.shard
    if info is None:
        return None
    n = info.full_shape[info.dim] // info.size
    ranges = tuple((r * n, n) for r in range(info.size))
    return Layout(tuple(info.full_shape), info.dim, ranges, info.rank, process_group_of(info.group))


def pad_shard(lay: Layout, t: torch.Tensor) -> torch.Tensor:
    """A shard flattened and zero-padded to the largest shard's size."""
    flat = t.contiguous().view(-1)
    need = lay.padded_numel() - flat.numel()
    return flat if need == 0 else torch.cat([flat, flat.new_zeros(need)])


def unpad_shard(lay: Layout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard back from its padded flat form."""
    shape = lay.shape(rank)
    return flat[: math.prod(shape)].view(shape)
