"""The one description of where a parameter lies on the mesh: the parallel plan's table, by name.

`apply` (glm5/parallel/plan.py) returns a `Layouts` and keeps it as `model.glm5_plan`: for every tensor it
split, a `ShardInfo` (the model axis: which dim, how many equal slices, which one this rank holds, over
which group), and `copies`, the group whose ranks hold whole, identical copies of every tensor it left
whole (the tensor-parallel group, or the expert-parallel group when its ranks hold the same tokens; None
when they hold different tokens or there is no model axis); `partial`, the copies whose gradients each
rank computes from its own tokens only (sequence parallel's norms, glm5/parallel/sequence.py).
Nothing is stored on the tensors themselves, so the description survives FSDP2 replacing them: on a
2-D mesh FSDP2 then chunks each tensor's dim 0 over the dp ranks, and that chunk is FSDP2's DTensor
placement, composed on top by whoever reads both (glm5/train/muon/layout.py for Muon,
glm5/train/distributed/checkpoint.py for DCP, glm5/train/distributed/runtime.py for the gradient sums and
norm).

Readers look a tensor up by its name (`layouts.get(name)`, `layouts.copies`), or by the tensor object
through `by_tensor(model)`, built when the optimizers or the gradient clip are set up (after FSDP2, whose
sharded parameters are the ones the optimizers hold).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from glm5.parallel.group import Group


@dataclass(frozen=True)
class ShardInfo:
    """What part of a full parameter this rank holds: `size` equal slices of dim `dim` (each a whole
    number of `unit` rows: heads, experts or vocabulary rows), this rank's is number `rank`."""

    kind: str  # 'heads' | 'colwise' | 'rowwise' | 'experts-tp' | 'experts-ep' | 'vocab'
    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]
    unit: int = 1
    group: Group | None = field(default=None, compare=False, repr=False)

    @property
    def length(self) -> int:
        return self.full_shape[self.dim] // self.size

    @property
    def start(self) -> int:
        return self.rank * self.length


@dataclass(frozen=True)
class ParamLayout:
    """One tensor's place on the model axis: a slice (`shard`), or whole on every rank of `copies`, or
    neither (whole, and no rank holds the same bits: a 1-process model, or ep over dp). `partial`: a copy
    each rank computes on its own tokens (sequence parallel's norms), whose gradients the trainer sums
    over that group before the step."""

    shard: ShardInfo | None = None
    copies: Group | None = None
    partial: Group | None = None  # a copy whose gradient is this rank's part of a sum over the group

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The whole tensor's shape (a DTensor's shape is already FSDP2's global one)."""
        return tuple(self.shard.full_shape) if self.shard is not None else tuple(t.shape)


WHOLE = ParamLayout()


class Layouts(Mapping[str, ShardInfo]):
    """name -> ShardInfo of every tensor the plan split (a Mapping, so `get(name)` is None for a whole
    one), `copies`, the group holding whole copies of the others, and `partial`, the names of the copies
    whose gradients are partial sums over that group."""

    def __init__(
        self, shards: dict[str, ShardInfo], copies: Group | None, partial: tuple[str, ...] = ()
    ) -> None:
        self._shards = dict(shards)
        self.copies = copies if copies is not None and copies.size > 1 else None
        self.partial = frozenset(partial)

    def __getitem__(self, name: str) -> ShardInfo:
        return self._shards[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def layout(self, name: str) -> ParamLayout:
        info = self._shards.get(name)
        if info is not None:
            return ParamLayout(info)
        return ParamLayout(None, self.copies, self.copies if name in self.partial else None)


def of(model: nn.Module) -> Layouts:
    """The model's Layouts (empty, no copies, for a model no plan split)."""
    got = getattr(model, "glm5_plan", None)
    return got if got is not None else Layouts({}, None)


def by_tensor(model: nn.Module) -> dict[torch.Tensor, ParamLayout]:
    """Every parameter's ParamLayout keyed by the parameter object (tensors hash by identity): what the
    optimizers and the gradient clip hold. Call it after FSDP2 (its sharded parameters are new objects)."""
    lay = of(model)
    return {p: lay.layout(name) for name, p in model.named_parameters()}
