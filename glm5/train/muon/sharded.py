"""Muon Split over sharded parameters (FSDP2 DTensors, tensor / expert parallel shards) that never
all-gathers what a rank does not own, with the same bits as the 1-process `Muon`.

Each Muon parameter takes one of two paths, fixed at construction from its shape and its sharding (its
entry in the plan's table, glm5/parallel/layout.py, passed as `placements`; FSDP2's DTensor placement):

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

A matrix every rank of a tensor / expert parallel group holds whole (the plan's `copies`, no FSDP: the
plan's replicated `q_a_proj`, indexer, router, ...) has the same gradient bits on every rank of that
group: one owner (balanced by cost) orthogonalises it and broadcasts the update, so Newton-Schulz still
runs once per matrix per step. Parameters replicated with no group named are updated on every rank.

On a 2-D mesh (dp x tp: FSDP2 over the dp ranks of a model the plan split) a parameter's
Layout spans every rank: a plan slice (its `ShardInfo`) that FSDP2 shards on dim 0 lies at the plan's
offset plus FSDP's chunk (a 'heads' / 'experts-ep' slice split on dim 0 twice still holds whole heads /
experts per rank when the counts divide: the local path); a slice of another dim is a 2-D box (dim 0
from FSDP, `dim2` from the plan). A parameter the plan left whole (the plan's `copies`: the tp / ep group
holding copies) has its one owner among all ranks, which receives every copy's FSDP shard (identical
bits; one is used) and sends each rank its part: one Newton-Schulz call per matrix per step over the
whole mesh, at the price of (tp - 1) redundant shards into the owner.

The elementwise parts (momentum, Nesterov, weight decay, the add) run on the local shard only; the
orthogonalised update is `Muon.update` on the same matrix bits either way, so each local shard equals
the slice of the 1-process result bitwise (tests/glm5/train/muon/test_sharded.py).

`last_step_bytes` holds the bytes this rank sent and received in the last step by category
('per-head', 'per-expert', 'matrix'); `muon_bytes` is the analytic figure for a model under FSDP-style
dim-0 sharding and three schemes: naive (all-gather every matrix), owner (one owner per matrix, no
split-awareness) and split (this optimizer).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from glm5.parallel import layout
from glm5.parallel.layout import WHOLE, ParamLayout
from glm5.train.muon.layout import (
    CATEGORIES,
    Layout,
    assign_owners,
    category,
    layout_of,
    ns_cost,
    pad_shard,
    process_group_of,
    unpad_shard,
)
from glm5.train.muon.optimizer import Blocks, Muon, build_optimizers


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
    copies: object = None  # the process group holding whole copies (the broadcast path), else None
    shape: tuple[int, ...] = ()  # the whole copy's shape (the broadcast path)


class DistributedMuon(Muon):
    """Muon (with Muon Split's Blocks) over sharded parameters; see the module docstring.

    `params` as for Muon: groups with `params` and `blocks`, the Blocks of each FULL parameter. All ranks
    of a parameter's process group must construct it with the same parameters in the same order and
    call `step` together. `scheme='owner'` sends every sharded matrix to its owner, whole heads and
    experts too (the split-unaware baseline the bench compares with). `ns_calls` / `ns_matrices` count
    Newton-Schulz calls and the matrices they orthogonalised on this rank (cumulative),
    `last_step_bytes` the last step's Traffic. `placements`: each parameter's ParamLayout
    (glm5/parallel/layout.py `by_tensor`: the plan's slice or copies); a parameter not in it is whole.
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
        placements: Mapping[torch.Tensor, ParamLayout] | None = None,
    ) -> None:
        placements = placements or {}
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
        replica_path: dict[object, list[_Entry]] = {}
        for group in self.param_groups:
            for p, blk in zip(group["params"], group["blocks"], strict=True):
                place = placements.get(p, WHOLE)
                lay = layout_of(p, place)
                full = lay.full_shape if lay else tuple(p.shape)
                if len(full) < 2 or blk.heads * sum(blk.sections) != math.prod(full[:-1]):
                    raise ValueError(f"blocks: {blk} does not tile a parameter of shape {full}")
                copies = None if isinstance(p, DTensor) else place.copies
                if lay is None and copies is not None:  # one owner, broadcast
                    entry = _Entry(
                        blk,
                        None,
                        None,
                        copies=process_group_of(copies) or dist.group.WORLD,
                        shape=tuple(p.shape),
                    )
                    replica_path.setdefault(entry.copies, []).append(entry)
                    self._entries[id(p)] = entry
                    continue
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
        for pg, entries in replica_path.items():
            costs = [ns_cost(e.blk, e.shape[-1]) for e in entries]
            for e, owner in zip(entries, assign_owners(costs, dist.get_world_size(pg)), strict=True):
                e.owner = owner

    def entry(self, p: torch.Tensor) -> _Entry:
        return self._entries[id(p)]

    def planned_bytes(self) -> Traffic:
        """The bytes `step` moves on this rank when every parameter has a gradient (from the layouts)."""
        t = Traffic()
        for e in self._entries.values():
            if e.copies is not None:  # the owner broadcasts the whole update
                n = math.prod(e.shape) * self._element_size
                world = dist.get_world_size(e.copies)
                owner = dist.get_rank(e.copies) == e.owner
                cat = category(e.blk, e.shape)
                (t.sent if owner else t.received)[cat] += n * (world - 1) if owner else n
                continue
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
        replicas: dict[tuple, list] = {}  # the same, for whole copies on every rank of a group
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
                if e.copies is not None:
                    replicas.setdefault((e.copies, u.dtype), []).append((e, w, u, lr, group["ns_steps"]))
                elif e.local_blk is not None:
                    if w.numel():
                        w.add_(self._orthogonalise(u, e.local_blk, group["ns_steps"]), alpha=-lr)
                else:
                    pending.setdefault((e.layout.group, u.dtype), []).append((e, w, u, lr, group["ns_steps"]))
        for items in pending.values():
            self._owner_exchange(items)
        for items in replicas.values():
            self._broadcast_updates(items)
        return loss

    def _broadcast_updates(self, items: list) -> None:
        """Whole copies on every rank of a group: each owner orthogonalises its matrices and broadcasts
        the updates (one broadcast per owner)."""
        pg = items[0][0].copies
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        for owner in range(world):
            mine = [it for it in items if it[0].owner == owner]
            if not mine:
                continue
            if rank == owner:
                flat = torch.cat([self._orthogonalise(u, e.blk, ns).reshape(-1) for e, _, u, _, ns in mine])
            else:
                flat = mine[0][2].new_empty(sum(it[2].numel() for it in mine))
            dist.broadcast(flat, group=pg, group_src=owner)
            for (e, w, u, lr, _), upd in zip(
                mine, torch.split(flat, [it[2].numel() for it in mine]), strict=True
            ):
                w.add_(upd.view_as(u), alpha=-lr)
                cat = category(e.blk, tuple(u.shape))
                n = upd.numel() * upd.element_size()
                if rank == owner:
                    self.last_step_bytes.sent[cat] += n * (world - 1)
                else:
                    self.last_step_bytes.received[cat] += n

    def _owner_exchange(self, items: list) -> None:
        """Gather each owner's matrices to it, orthogonalise them there, scatter the slices back."""
        lay0 = items[0][0].layout
        world, rank, pg = lay0.world, lay0.rank, lay0.group
        for owner in range(world):
            mine = [it for it in items if it[0].owner == owner]
            if not mine:
                continue
            sizes = [it[0].layout.padded_numel() for it in mine]
            send = torch.cat([pad_shard(it[0].layout, it[2]) for it in mine])
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
                        full[lay.box(r)] = unpad_shard(lay, pieces[r][k], r)
                    upd = self._orthogonalise(full, e.blk, ns_steps)
                    updates.append([pad_shard(lay, upd[lay.box(r)]) for r in range(world)])
                scatter = [torch.cat([u[r] for u in updates]) for r in range(world)]
            else:
                scatter = None
            dist.scatter(out, scatter, group=pg, group_src=owner)
            self._count(mine, sizes, out.element_size(), world, to_owner=False, owner=rank == owner)
            for (e, w, _, lr, _), piece in zip(mine, torch.split(out, sizes), strict=True):
                w.add_(unpad_shard(e.layout, piece, rank), alpha=-lr)

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


# -- building the optimizers ---------------------------------------------------------------------------
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
    places = layout.by_tensor(model)
    return build_optimizers(
        model,
        mode,
        lr,
        weight_decay,
        betas,
        momentum,
        muon_cls=functools.partial(DistributedMuon, placements=places),
        full_shape=lambda p: places[p].full_shape(p),
    )
