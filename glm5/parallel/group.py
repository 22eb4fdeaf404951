"""The communication a parallel plan needs, behind one small interface with two hosts.

A `Group` is one parallel dimension (tensor, expert or data parallel) of whatever engine runs the model:
`TorchGroup` wraps a torch.distributed process group (training, tests), `glm5.vllm.parallel` wraps
vLLM's group coordinators (serving). The plan (glm5/parallel/plan.py) and the expert dispatch
(backends/moe/expert_parallel.py) only call the methods below, so the model is sharded the same way under
both hosts.

Exactness policy (SPEC 11). A sum over ranks is the host's own collective by default (torch.distributed's
all-reduce / reduce-scatter, vLLM's communicator: NCCL, HCCL, vLLM's custom all-reduce, shared memory on
CPU): ring cost, and the bits depend on that algorithm and the group size. `exact=True` asks for the fixed
rank-order sum `x_0 + x_1 + ... + x_{N-1}`, whose bits depend on nothing but the group size, for the
callers that promise bits across layouts: the layout-invariant mode (SPEC 12) and every sum while
`GLM5_VALIDATE` is set (`exact_sums()`). The fixed order costs ring bytes too: each rank receives every
rank's copy of one 1/N chunk (an all-to-all), adds them in rank order and the chunks are all-gathered.
What the default path needs is weaker: the replicated router and indexer (and the replicated parameters'
gradients) need every rank to get the same bits, not the unsplit model's; gloo's and NCCL's ring and tree
all-reduces reduce each chunk once and copy it to every rank, so they do, and GLM5_VALIDATE=topk's
agreement check (glm5/parallel/agreement.py) is where a host that did not would show.

The collectives used in a forward pass are differentiable in the Megatron sense, so the same plan
trains: `enter` (identity forward, all-reduce of the gradient backward) marks where a replicated
activation enters a sharded computation; `reduce` (all-reduce forward, identity backward) where a
row-parallel partial sum leaves it; `gather` concatenates shards along a dimension (backward: the
local slice of the gradient). The expert exchange's differentiable all-to-all (backward: the reverse
exchange) lives with the dispatch that uses it, backends/moe/expert_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from backends.interface import validation_mode
from backends.invariant import engine as _invariant


class Group(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """Sum over ranks (a new tensor). exact=True: the fixed rank-order sum (module docstring)."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order."""

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x [N * c, ...] on every rank -> this rank's chunk [c, ...] of the sum over ranks."""

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows x[sum(send[:s]) : sum(send[:s+1])] go to rank s; the result holds recv[s] rows from
        each rank s, in rank order: [sum(recv), ...]. send / recv are host ints (variable splits).
        Rows arrive bit for bit (a copy, never arithmetic): the masked expert dispatch sends its counts'
        bytes as header rows of x's dtype (SPEC 11.1)."""

    # optional: `expert_steps`, an object with `layout`, `dispatch` and `combine` as in
    # backends/moe/expert_parallel.py (SPEC 11.1), for a host whose fused kernels (DeepEP, Ascend MC2) do
    # expert parallel's exchange; without it the plan runs the reference steps on `all_to_all`


def exact_sums() -> bool:
    """True where sums over ranks must be the fixed rank-order ones: the layout-invariant mode and
    GLM5_VALIDATE (read at each collective the plan issues, as the mode itself is)."""
    return _invariant.active() or validation_mode() != ""


@dataclass(frozen=True)
class Single:
    """One rank: every collective is the identity (the unsharded model through the same code)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return x

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return x


def sum_in_rank_order(parts) -> torch.Tensor:
    """parts[0] + parts[1] + ... in that order (a new tensor): the fixed-order sum."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def fixed_order_reduce_scatter(group: Group, x: torch.Tensor) -> torch.Tensor:
    """x [N * c, ...] -> the rank's chunk of sum_s x_s added in rank order: every rank's copy of the
    chunk arrives by one all-to-all ((N-1)/N of x per rank, a ring reduce-scatter's bytes)."""
    c = x.shape[0] // group.size
    parts = group.all_to_all(x.contiguous(), [c] * group.size, [c] * group.size)
    return sum_in_rank_order(parts.unflatten(0, (group.size, c)))


def fixed_order_all_reduce(group: Group, x: torch.Tensor) -> torch.Tensor:
    """sum_s x_s added in rank order, the same bits on every rank, at a ring all-reduce's bytes: the
    flat tensor (zero-padded to N chunks) is reduce-scattered in rank order, then all-gathered. Each
    element is added exactly as `sum_in_rank_order` over an all-gather would add it."""
    n = group.size
    flat = x.reshape(-1)
    c = -(-flat.numel() // n)
    padded = torch.cat([flat, flat.new_zeros(c * n - flat.numel())]) if c * n != flat.numel() else flat
    mine = fixed_order_reduce_scatter(group, padded)
    return group.all_gather(mine, 0)[: flat.numel()].view(x.shape)


class TorchGroup:
    """A torch.distributed process group (gloo, nccl, hccl) as a `Group`: the backend's own all-reduce and
    reduce-scatter, `all_to_all_single` for the variable-split exchange, the fixed order on request."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_all_reduce(self, x)
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_reduce_scatter(self, x)
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        dist.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=self.group)
        return out


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
    def forward(ctx, x: torch.Tensor, group: Group, exact: bool) -> torch.Tensor:
        return group.all_reduce(x, exact=exact)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.width = group, dim, x.shape[dim]
        return group.all_gather(x, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        start = ctx.group.rank * ctx.width
        return g.narrow(ctx.dim, start, ctx.width).contiguous(), None, None


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, exact: bool) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x.contiguous(), exact=exact)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.group.all_gather(g.contiguous(), 0), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        c = x.shape[0] // group.size
        return x.narrow(0, group.rank * c, c).contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.group.all_gather(g.contiguous(), 0), None


def enter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated activation entering a sharded computation (gradient summed over the group)."""
    return x if group.size == 1 or not torch.is_grad_enabled() else _Enter.apply(x, group)


def reduce(x: torch.Tensor, group: Group, exact: bool | None = None) -> torch.Tensor:
    """Sum of the group's partial results (row-parallel output); exact=None: `exact_sums()`."""
    if group.size == 1:
        return x
    exact = exact_sums() if exact is None else exact
    return _Reduce.apply(x, group, exact) if torch.is_grad_enabled() else group.all_reduce(x, exact=exact)


def gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """The group's shards concatenated along dim in rank order."""
    if group.size == 1:
        return x
    return _Gather.apply(x, group, dim) if torch.is_grad_enabled() else group.all_gather(x, dim)


def reduce_scatter(x: torch.Tensor, group: Group, exact: bool | None = None) -> torch.Tensor:
    """This rank's chunk of dim 0 of the sum of the group's partial results (a row-parallel output
    leaving into a sequence-parallel region; backward: the gradient all-gathered); exact=None:
    `exact_sums()`."""
    if group.size == 1:
        return x
    exact = exact_sums() if exact is None else exact
    if torch.is_grad_enabled():
        return _ScatterSum.apply(x, group, exact)
    return group.reduce_scatter(x.contiguous(), exact=exact)


def scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunk of dim 0 of a tensor every rank holds whole (entering a sequence-parallel
    region; backward: the gradient all-gathered)."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(
            f"sequence parallel: {x.shape[0]} tokens do not split into {group.size} equal parts "
            "(the tokens of a step must divide by tp)"
        )
    if torch.is_grad_enabled():
        return _Split.apply(x, group)
    c = x.shape[0] // group.size
    return x.narrow(0, group.rank * c, c).contiguous()
