"""Muon Split over sharded parameters (FSDP2 DTensors, tensor / expert parallel shards) that never
all-gathers what a rank does not own, with the same bits as the 1-process `Muon`.

Each Muon parameter takes one of two paths, fixed at construction from its shape and its sharding:

- **local**: the shard holds whole Muon blocks (whole heads of `q_b_proj` / `kv_b_proj` under Muon
  Split, whole routed experts of a stacked `[E, r, c]` parameter), so Newton-Schulz runs on the shard:
  zero bytes. FSDP2 shards dim 0 as `torch.chunk` does (ceil(rows / world) rows a rank, the last ranks
  possibly fewer or none); a parameter takes this path only if every rank's row range starts and ends
  on a block boundary.
- **owner**: every other sharded matrix has exactly one owner rank in its process group (greedy
  largest-first by Newton-Schulz cost, `assign_owners`). The other ranks send it their shard of the
  momentum-updated matrix (`dist.gather` to the owner, padded to the largest shard), the owner runs
  Newton-Schulz once and sends each rank its slice of the update back (`dist.scatter`). Matrices are
  batched into one gather and one scatter per owner.

Parameters that are not sharded at all (replicated) are updated on every rank, without communication.

On a 2-D mesh (dp x tp, dp x ep: FSDP2 over the dp ranks of a model the plan split) a parameter's
Layout spans every rank: a plan slice (`p.glm5_shard`) that FSDP2 shards on dim 0 lies at the plan's
offset plus FSDP's chunk (a 'heads' / 'experts-ep' slice split on dim 0 twice still holds whole heads /
experts per rank when the counts divide: the local path); a slice of another dim is a 2-D box (dim 0
from FSDP, `dim2` from the plan). A parameter the plan left whole (`p.glm5_replicas`: the tp / ep group
holding copies) has its one owner among all ranks, which receives every copy's FSDP shard (identical
bits; one is used) and sends each rank its part: one Newton-Schulz call per matrix per step over the
whole mesh, at the price of (tp - 1) redundant shards into the owner.

The elementwise parts (momentum, Nesterov, weight decay, the add) run on the local shard only; the
orthogonalised update is `Muon.update` on the same matrix bits either way, so each local shard equals
the slice of the 1-process result bitwise (tests/glm5/train/test_muon_dist.py).

`last_step_bytes` holds the bytes this rank sent and received in the last step by category
('per-head', 'per-expert', 'matrix'); `muon_bytes` is the analytic figure for a model under FSDP-style
dim-0 sharding and three schemes: naive (all-gather every matrix), owner (one owner per matrix, no
split-awareness) and split (this optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from glm5.train.muon import MODES, Blocks, Muon, blocks_for, uses_adamw

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


def _process_group(group) -> dist.ProcessGroup | None:
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


def _layout_2d(p: DTensor, mesh, i: int) -> Layout | None:
    """A plan slice or a plan-replicated parameter that FSDP2 sharded over the dp ranks: its Layout over
    every rank of the 2-D mesh (the default group), or None when `p` carries neither mark."""
    info = getattr(p, "glm5_shard", None)
    copies = getattr(p, "glm5_replicas", None)
    if info is None and copies is None:
        return None
    model_pg = _process_group(info.group if info is not None else copies)
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


def layout_of(p: torch.Tensor) -> Layout | None:
    """The Layout of a sharded parameter: an FSDP2 / DTensor `Shard(0)` over one mesh dimension (others
    replicated), or a tensor / expert parallel shard carrying `p.glm5_shard`, or both on a 2-D mesh
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
        two_d = _layout_2d(p, mesh, i)
        if two_d is not None:
            return two_d
        ranges = chunk_ranges(p.shape[0], mesh.size(i))
        return Layout(tuple(p.shape), 0, ranges, mesh.get_local_rank(i), mesh.get_group(i))
    info = getattr(p, "glm5_shard", None)
    if info is None:
        return None
    n = info.full_shape[info.dim] // info.size
    ranges = tuple((r * n, n) for r in range(info.size))
    return Layout(tuple(info.full_shape), info.dim, ranges, info.rank, _process_group(info.group))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# -- the optimizer -------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """Bytes one rank sent and received in one step, by category."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())


@dataclass
class _Entry:
    """One Muon parameter's place in the step: its Blocks (of the full parameter), its Layout and path."""

    blk: Blocks
    layout: Layout | None
    local_blk: Blocks | None  # set: updated on the shard (or replicated); None: the owner path
    owner: int = -1


class DistributedMuon(Muon):
    """Muon (with Muon Split's Blocks) over sharded parameters; see the module docstring.

    `params` as for Muon: groups with `params` and `blocks`, the Blocks of each FULL parameter. All ranks
    of a parameter's process group must construct it with the same parameters in the same order and
    call `step` together. `scheme='owner'` sends every sharded matrix to its owner, whole heads and
    experts too (the split-unaware baseline the bench compares with). `ns_calls` / `ns_matrices` count
    Newton-Schulz calls and the matrices they orthogonalised on this rank (cumulative),
    `last_step_bytes` the last step's Traffic.
    """

    def __init__(
        self,
        params: Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        scheme: str = "split",
    ) -> None:
        if scheme not in ("owner", "split"):
            raise ValueError(f"scheme: expected 'owner' or 'split', got {scheme!r}")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps
        )
        # Muon.__init__ checks the Blocks against p.shape, which is a tensor-parallel shard's local shape
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.ns_dtype = ns_dtype
        self.ns_calls = 0
        self.ns_matrices = 0
        self.last_step_bytes = Traffic()
        self._entries: dict[int, _Entry] = {}
        owner_path: dict[object, list[_Entry]] = {}
        for group in self.param_groups:
            for p, blk in zip(group["params"], group["blocks"], strict=True):
                lay = layout_of(p)
                full = lay.full_shape if lay else tuple(p.shape)
                if len(full) < 2 or blk.heads * sum(blk.sections) != math.prod(full[:-1]):
                    raise ValueError(f"blocks: {blk} does not tile a parameter of shape {full}")
                if lay is None:  # replicated: updated on every rank
                    local_blk = blk
                else:
                    local_blk = lay.local_blocks(blk) if scheme == "split" else None
                entry = _Entry(blk, lay, local_blk)
                self._entries[id(p)] = entry
                if local_blk is None:
                    owner_path.setdefault(lay.group, []).append(entry)
        for entries in owner_path.values():
            costs = [ns_cost(e.blk, e.layout.full_shape[-1]) for e in entries]
            for e, owner in zip(entries, assign_owners(costs, entries[0].layout.world), strict=True):
                e.owner = owner

    def entry(self, p: torch.Tensor) -> _Entry:
        return self._entries[id(p)]

    def planned_bytes(self) -> Traffic:
        """The bytes `step` moves on this rank when every parameter has a gradient (from the layouts)."""
        t = Traffic()
        for e in self._entries.values():
            if e.local_blk is not None:
                continue
            lay = e.layout
            chunk = lay.padded_numel() * self._element_size
            cat = category(e.blk, lay.full_shape)
            n = chunk * (lay.world - 1) if lay.rank == e.owner else chunk
            t.sent[cat] += n
            t.received[cat] += n
        return t

    @property
    def _element_size(self) -> int:
        return next(p.element_size() for g in self.param_groups for p in g["params"])

    def _orthogonalise(self, u: torch.Tensor, blk: Blocks, ns_steps: int) -> torch.Tensor:
        self.ns_calls += len(blk.sections)
        self.ns_matrices += blk.heads * len(blk.sections)
        return self.update(u, blk, ns_steps)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim API
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_bytes = Traffic()
        pending: dict[tuple, list] = {}  # (group, dtype) -> [(entry, local param, u, lr, ns_steps)]
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p, _ in zip(group["params"], group["blocks"], strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor for a DTensor: DCP saves it
                w, g, buf = _local(p), _local(p.grad), _local(state["momentum_buffer"])
                buf.lerp_(g, 1 - mom)
                u = g.lerp(buf, mom) if group["nesterov"] else buf
                w.mul_(1 - lr * wd)
                e = self._entries[id(p)]
                if e.local_blk is not None:
                    if w.numel():
                        w.add_(self._orthogonalise(u, e.local_blk, group["ns_steps"]), alpha=-lr)
                else:
                    pending.setdefault((e.layout.group, u.dtype), []).append((e, w, u, lr, group["ns_steps"]))
        for items in pending.values():
            self._owner_exchange(items)
        return loss

    def _owner_exchange(self, items: list) -> None:
        """Gather each owner's matrices to it, orthogonalise them there, scatter the slices back."""
        lay0 = items[0][0].layout
        world, rank, pg = lay0.world, lay0.rank, lay0.group
        for owner in range(world):
            mine = [it for it in items if it[0].owner == owner]
            if not mine:
                continue
            sizes = [it[0].layout.padded_numel() for it in mine]
            send = torch.cat([_pad(it[0].layout, it[2]) for it in mine])
            parts = [torch.empty_like(send) for _ in range(world)] if rank == owner else None
            dist.gather(send, parts, group=pg, group_dst=owner)
            self._count(mine, sizes, send.element_size(), world, to_owner=True, owner=rank == owner)
            out = torch.empty_like(send)
            if rank == owner:
                pieces = [torch.split(part, sizes) for part in parts]
                updates = []
                for k, (e, _, _, _, ns_steps) in enumerate(mine):
                    lay = e.layout
                    full = pieces[0][k].new_empty(lay.full_shape)
                    for r in range(world):  # copies of one part (2-D mesh) hold the same bits
                        full[lay.box(r)] = _unpad(lay, pieces[r][k], r)
                    upd = self._orthogonalise(full, e.blk, ns_steps)
                    updates.append([_pad(lay, upd[lay.box(r)]) for r in range(world)])
                scatter = [torch.cat([u[r] for u in updates]) for r in range(world)]
            else:
                scatter = None
            dist.scatter(out, scatter, group=pg, group_src=owner)
            self._count(mine, sizes, out.element_size(), world, to_owner=False, owner=rank == owner)
            for (e, w, _, lr, _), piece in zip(mine, torch.split(out, sizes), strict=True):
                w.add_(_unpad(e.layout, piece, rank), alpha=-lr)

    def _count(
        self, mine: list, sizes: list[int], esize: int, world: int, to_owner: bool, owner: bool
    ) -> None:
        """One gather (`to_owner`) or scatter: the owner receives / sends world - 1 chunks, every other
        rank sends / receives one."""
        receiving = to_owner == owner
        for (e, *_), n in zip(mine, sizes, strict=True):
            cat = category(e.blk, e.layout.full_shape)
            b = n * esize * (world - 1 if owner else 1)
            (self.last_step_bytes.received if receiving else self.last_step_bytes.sent)[cat] += b


def _pad(lay: Layout, t: torch.Tensor) -> torch.Tensor:
    """A shard flattened and zero-padded to the largest shard's size."""
    flat = t.contiguous().view(-1)
    need = lay.padded_numel() - flat.numel()
    return flat if need == 0 else torch.cat([flat, flat.new_zeros(need)])


def _unpad(lay: Layout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard back from its padded flat form."""
    shape = lay.shape(rank)
    return flat[: math.prod(shape)].view(shape)


# -- building the optimizers ---------------------------------------------------------------------------
def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    info = getattr(p, "glm5_shard", None)
    return tuple(info.full_shape) if info is not None else tuple(p.shape)  # a DTensor's shape is global


def build_distributed_optimizers(
    model: nn.Module,
    mode: str = "muon-split",
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.95,
) -> list[torch.optim.Optimizer]:
    """`build_optimizers` for a sharded GLM-5 (FSDP2 and / or glm5.parallel.plan): [DistributedMuon,
    AdamW] (or [AdamW] for mode 'adamw'). AdamW is elementwise, so torch's runs on the shards as is."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    muon_p, muon_b, adam_p = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if mode == "adamw" or uses_adamw(name, p):
            adam_p.append(p)
        else:
            full = torch.empty(_full_shape(p), device="meta")
            muon_p.append(p)
            muon_b.append(blocks_for(name, full, model.config, split=mode == "muon-split"))
    opts: list[torch.optim.Optimizer] = []
    if muon_p:
        opts.append(
            DistributedMuon(
                [{"params": muon_p, "blocks": muon_b}], lr=lr, momentum=momentum, weight_decay=weight_decay
            )
        )
    if adam_p:
        opts.append(torch.optim.AdamW(adam_p, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False))
    return opts
