"""The communication a parallel plan needs, behind one small interface with two hosts.

A `Group` is one parallel dimension (tensor or expert parallel) of whatever engine runs the model:
`TorchGroup` wraps a torch.distributed process group (training, tests), `glm5.vllm.parallel` wraps
vLLM's group coordinators (serving). The plan (glm5/parallel/plan.py) only calls the methods below,
so the model is sharded the same way under both hosts.

The collectives used in a forward pass are differentiable in the Megatron sense, so the same plan
trains: `enter` (identity forward, all-reduce of the gradient backward) marks where a replicated
activation enters a sharded computation; `reduce` (all-reduce forward, identity backward) where a
row-parallel partial sum leaves it; `gather` concatenates shards along a dimension (backward: the
local slice of the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class Group(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a new tensor; every rank gets the same bits)."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order."""


@dataclass(frozen=True)
class Single:
    """One rank: every collective is the identity (the unsharded model through the same code)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


def sum_in_rank_order(parts) -> torch.Tensor:
    """parts[0] + parts[1] + ... in that order (a new tensor): the fixed-order sum every host's
    `all_reduce` gives, so every rank gets the same bits whatever its communicator would do."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


class TorchGroup:
    """A torch.distributed process group (gloo, nccl, hccl) as a `Group`.

    `all_reduce` gathers every rank's tensor and sums them in rank order, so the result is the same
    bits on every rank and does not depend on the backend's reduction algorithm (gloo's ring order
    changes with the world size); it moves `size` times the bytes of a ring all-reduce, which is the
    price of a fixed order.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return sum_in_rank_order(parts)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.group.all_reduce(g), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.width = group, dim, x.shape[dim]
        return group.all_gather(x, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        start = ctx.group.rank * ctx.width
        return g.narrow(ctx.dim, start, ctx.width).contiguous(), None, None


def enter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated activation entering a sharded computation (gradient summed over the group)."""
    return x if group.size == 1 or not torch.is_grad_enabled() else _Enter.apply(x, group)


def reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of the group's partial results (row-parallel output)."""
    if group.size == 1:
        return x
    return _Reduce.apply(x, group) if torch.is_grad_enabled() else group.all_reduce(x)


def gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """The group's shards concatenated along dim in rank order."""
    if group.size == 1:
        return x
    return _Gather.apply(x, group, dim) if torch.is_grad_enabled() else group.all_gather(x, dim)
