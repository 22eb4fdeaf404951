"""`glm5 train --nproc N --mesh dp=N|tp=N|ep=N|dp=D,tp=T|dp=N,ep=N|tp=N,sp=N`: training on N processes with
torch.distributed (sp: sequence parallel for the norms over the tp ranks, glm5/parallel/sequence.py).

- `launch` re-runs the command line (sys.argv) under torchrun's launcher (`elastic_launch`), one
  process per rank; a command already under torchrun (RANK / WORLD_SIZE set) runs as its rank.
- `Dist.setup` starts the process group (gloo on CPU, nccl on CUDA, hccl on Ascend) and the DeviceMesh.
  `Dist.shard` with dp: FSDP2 `fully_shard`, every decoder layer its own unit, the MTP layer,
  embedding, final norm and output head in the root unit (the MTP loss reads `shared_head.norm` and
  `lm_head.weight` after the model's forward returned, so the root keeps them gathered until its
  backward). ZeRO-3 frees each layer's gathered parameters after its forward
  (reshard_after_forward=True), ZeRO-2 keeps them to the backward; gradients and optimizer state are
  sharded either way. With tp or ep: the one parallel plan, glm5/parallel/plan.py. dp=N,ep=N: experts
  split over the dp ranks themselves (`ep_tokens="local"`, a 1-D dp mesh), out of FSDP2. A 2-D mesh
  (dp x tp; DeviceMesh (dp, tp), the model axis inner): the plan over the tp sub-group first, then FSDP2
  over the dp sub-mesh on each rank's slices. Where each parameter lies is described once, by name, in
  the plan's table (`model.glm5_plan`, glm5/parallel/layout.py: its slice of the model axis, or whole
  copies over the tp / ep group); FSDP2's dim-0 chunk over dp is its DTensor placement on top, and
  DistributedMuon, the gradient clip and the checkpoints compose the two. Stage warmup at dp > 1: the
  indexers (its only trainable parameters, whose KL loss never reaches a decoder layer's output, so
  FSDP2's backward hooks would not run) stay out of FSDP, replicated, and their gradients
  are averaged over dp explicitly (in rank order, as FSDP2 sums).
- Optimizers: `DistributedMuon` (glm5/train/muon/sharded.py: per-head and per-expert shards updated in
  place, every other matrix by one owner) and AdamW on the shards.
- `DistBalancer`: the aux-loss-free expert bias moves on the expert load summed over the dp ranks.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from glm5.parallel import layout as layouts
from glm5.train.distributed.mesh import Mesh
from glm5.train.loop.dsa import ExpertBalancer
from glm5.train.muon.sharded import build_distributed_optimizers

#: set by `launch` for its ranks: the launching process holds the run's lock (pid)
LOCK_HOLDER_ENV = "GLM5_TRAIN_LOCK_PID"
ZERO_STAGES = (2, 3)
_PG_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def under_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(argv: list[str], nproc: int) -> dict:
    """Run `glm5 <argv>` on `nproc` local processes under torchrun; the failed ranks (rank -> torch elastic's
    ProcessFailure: exitcode, negative for a signal; pid), empty if none failed. A SIGINT / SIGTERM of the
    launcher stops the ranks and raises SignalException. The caller holds the run's lock (ownership.py)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun --standalone: a rendezvous on a free local port
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )
    os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "glm5.cli", *argv)
    except ChildFailedError as exc:
        return dict(exc.failures)
    finally:
        os.environ.pop(LOCK_HOLDER_ENV, None)
    return {}


def lock_held_by_launcher() -> bool:
    """True in a rank that `launch` started (its parent process) while holding the run's lock."""
    return under_torchrun() and os.environ.get(LOCK_HOLDER_ENV) == str(os.getppid())


def rank() -> int:
    """This process's global rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


@dataclass
class Dist:
    """One rank of a run on several processes: the mesh, the FSDP stage and this rank's place in it."""

    mesh: Mesh
    zero: int
    device_mesh: DeviceMesh
    rank: int
    world: int

    @classmethod
    def setup(cls, mesh: Mesh, zero: int, device: torch.device | str) -> Dist:
        """Join the process group (from torchrun's environment) and build the DeviceMesh: 1-D named after
        the mesh's one axis above 1, or 2-D (dp, tp|ep)."""
        device = torch.device(device)
        if zero not in ZERO_STAGES:
            raise ValueError(f"zero: expected one of {ZERO_STAGES}, got {zero!r}")
        if not dist.is_initialized():
            if device.type != "cpu":
                torch.get_device_module(device.type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(_PG_BACKEND.get(device.type, "gloo"))
        world = dist.get_world_size()
        if world != mesh.size:
            raise ValueError(f"mesh: {mesh} covers {mesh.size} processes, the run has {world}")
        if mesh.dp > 1 and mesh.model_axis is not None and not mesh.ep_over_dp:
            axis = mesh.model_axis
            dm = init_device_mesh(device.type, (mesh.dp, world // mesh.dp), mesh_dim_names=("dp", axis))
        else:
            dm = init_device_mesh(device.type, (world,), mesh_dim_names=(mesh.axis,))
        d = cls(mesh, zero, dm, dist.get_rank(), world)
        d._ep_group = dist.new_group(list(range(world))) if mesh.ep_over_dp else None  # every rank, once
        return d

    @property
    def two_d(self) -> bool:
        return self.device_mesh.ndim == 2

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank("dp") if self.mesh.dp > 1 else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's data-parallel copies (None without dp)."""
        return self.device_mesh.get_group("dp") if self.mesh.dp > 1 else None

    @property
    def model_group(self) -> dist.ProcessGroup | None:
        """The process group the plan splits the model over (None without tp / ep); ep over dp: a group of its
        own on the dp ranks (`setup`), so the dispatch never shares a communicator with FSDP2's prefetches."""
        if self.mesh.ep_over_dp:
            return self._ep_group
        return None if self.mesh.model_axis is None else self.device_mesh.get_group(self.mesh.model_axis)

    _ep_group: dist.ProcessGroup | None = None

    @classmethod
    def for_run(
        cls, mesh: Mesh, zero: int, model: torch.nn.Module, batch_size: int, plain_checkpoint=None
    ) -> Dist:
        """`setup` and `shard` for a Trainer, after checking the global batch divides by dp and that it
        does not resume a 1-process checkpoint (`plain_checkpoint`: its optimizer state is not sharded)."""
        if batch_size % mesh.dp:
            raise ValueError(f"batch_size: the global batch ({batch_size}) must divide by dp ({mesh.dp})")
        if plain_checkpoint is not None:
            raise ValueError(
                f"resume: {plain_checkpoint} was written by a 1-process run; resume it without --nproc"
            )
        d = cls.setup(mesh, zero, model.backend.device)
        d.shard(
            model,
            frozen_base=not any(p.requires_grad for n, p in model.named_parameters() if ".indexer." not in n),
        )
        return d

    def global_record(self, rec: dict) -> dict:
        """A step's metrics record for the global batch: the mean of the ranks' losses, the largest logit."""
        for key in ("loss", "lm_loss", "mtp_loss", "kl_loss"):
            rec[key] = None if rec[key] is None else self.mean(rec[key])
        rec["max_attn_logit"] = self.max(rec["max_attn_logit"])
        return rec

    def global_rl_record(self, rec: dict) -> dict:
        """An RL step's record for the global batch: means over the ranks' equal shares (the ranks of a
        tp / ep group hold copies, so the mean over all ranks is the mean over dp), the reward's standard
        deviation over every rollout, extremes over all; grad_norm is global already."""
        second = self.mean(rec["reward_std"] ** 2 + rec["reward_mean"] ** 2)
        for key in ("loss", "reward_mean", "popped", "clipped", "moe_max_violation", "mismatch_outside"):
            rec[key] = self.mean(rec[key])
        rec["reward_std"] = max(second - rec["reward_mean"] ** 2, 0.0) ** 0.5
        for key in ("mismatch_min", "ppo_ratio_min"):
            rec[key] = -self.max(-rec[key])
        for key in ("mismatch_max", "ppo_ratio_max", "max_attn_logit"):
            rec[key] = self.max(rec[key])
        rec["response_tokens"] *= self.mesh.dp
        rec["tokens"] *= self.mesh.dp
        return rec

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes metrics, the summary and plots."""
        return self.rank == 0

    @property
    def model_parallel(self) -> bool:
        """tp or ep: the model split by glm5.parallel.plan (alone or under FSDP on a 2-D mesh)."""
        return self.mesh.model_axis is not None

    def shard(self, model: torch.nn.Module, frozen_base: bool = False) -> None:
        """tp / ep: the one parallel plan (glm5/parallel/plan.py) over the model axis's group. dp: then
        FSDP2 in place over the dp (sub-)mesh, each decoder layer a unit, the rest (MTP layer included)
        the root unit. `frozen_base` (stage warmup): the indexers stay out of FSDP (see the module
        docstring; `clip_grad_norm` averages their gradients)."""
        from torch.distributed.fsdp import fully_shard

        if self.model_parallel:
            from glm5.parallel.group import Single, TorchGroup
            from glm5.parallel.plan import apply

            group = TorchGroup(self.model_group)
            if self.mesh.model_axis == "tp":
                apply(model, tp=group, sequence_parallel=self.mesh.sp > 1)
            elif self.mesh.ep_over_dp:
                apply(model, tp=Single(), ep=group, ep_tokens="local")
            else:
                apply(model, tp=Single(), ep=group)
        self._layouts = layouts.by_tensor(model)  # replaced below for the parameters FSDP2 shards
        if self.mesh.dp == 1:
            return
        dp_mesh = self.device_mesh["dp"] if self.two_d else self.device_mesh
        ignored = {p for n, p in model.named_parameters() if ".indexer." in n} if frozen_base else set()
        if self.mesh.ep_over_dp:  # own experts, out of FSDP2; gradient (all ranks' tokens) / dp as FSDP2's
            experts = [p for n, p in model.named_parameters() if n in layouts.of(model)]
            for p in experts:
                p.register_hook(lambda g: g / self.mesh.dp)
            ignored |= set(experts)
        ignored = ignored or None
        reshard = self.zero == 3
        # the model returns views (e.g. its loss); nothing here modifies them in place
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        for layer in model.model.layers[: model.config.num_hidden_layers]:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
        # the root keeps its parameters gathered after forward: the MTP loss runs after model() returns
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored)
        self._layouts = layouts.by_tensor(model)

    @staticmethod
    def reshard(model: torch.nn.Module) -> None:
        """Free what a forward without backward (evaluation) left gathered: the root unit keeps its
        parameters after forward, and until it is resharded the model's registered parameters are the
        gathered ones, not the shards the optimizers and checkpoints hold."""
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def local_batch(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the global batch [B, ...] (B divides by dp: checked by the CLI / Trainer);
        the ranks of one tp / ep group see the same slice."""
        per = ids.shape[0] // self.mesh.dp
        if per == ids.shape[0]:
            return ids
        return ids[self.dp_rank * per : (self.dp_rank + 1) * per]

    def optimizers(self, model: torch.nn.Module, mode: str, lr: float, weight_decay: float) -> list:
        """[DistributedMuon, AdamW] over the sharded parameters (glm5/train/muon/sharded.py)."""
        return build_distributed_optimizers(model, mode, lr, weight_decay)

    def balancer(self, model: torch.nn.Module, gamma: float) -> ExpertBalancer:
        # the router is replicated over tp / ep: every rank of that group counts the same tokens
        return DistBalancer(model, gamma, self.dp_group) if self.mesh.dp > 1 else ExpertBalancer(model, gamma)

    @property
    def plan_mesh(self) -> DeviceMesh | None:
        """The mesh the plan's slices lie on (for checkpoints; None without tp / ep): the model axis's
        1-D mesh, or on a 2-D mesh the (tp|ep, dp) view of it, the plan's split first, then FSDP's."""
        if not self.model_parallel:
            return None
        if not self.two_d:
            return self.device_mesh
        if self._plan_mesh is None:  # every rank builds it once, in the same order (it makes groups)
            axis = self.mesh.model_axis
            self._plan_mesh = DeviceMesh(
                self.device_mesh.device_type,
                self.device_mesh.mesh.t().contiguous(),
                mesh_dim_names=(axis, "dp"),
            )
        return self._plan_mesh

    _plan_mesh: DeviceMesh | None = None
    _layouts: dict | None = None  # parameter -> ParamLayout (glm5/parallel/layout.py), set by `shard`

    def _layout(self, p: torch.Tensor) -> layouts.ParamLayout:
        return (self._layouts or {}).get(p, layouts.WHOLE)

    def sync_replicated_grads(self, params: list[torch.Tensor]) -> None:
        """The sums the backward leaves to the step: a copy whose gradient is partial over its group (its
        Layout's `partial`: sequence parallel's norms) summed over it (on FSDP2's local chunk on a 2-D
        mesh); then at dp > 1 the mean over the dp ranks of the gradients FSDP2 does not reduce
        (parameters kept out of it: the warm-up's indexers), summed in rank order as FSDP2 sums (each
        divided by dp first)."""
        from glm5.parallel.group import TorchGroup

        for p in params:
            part = self._layout(p).partial
            if p.grad is not None and part is not None:
                g = local(p.grad)
                g.copy_(part.all_reduce(g))
        if self.mesh.dp == 1:
            return
        group = TorchGroup(self.dp_group)
        for p in params:  # (a plan slice here is a rank's own experts, ep over dp: not a copy)
            sliced = self._layout(p).shard is not None
            if p.grad is not None and not isinstance(p, DTensor) and not sliced:
                p.grad.copy_(group.all_reduce(p.grad / self.mesh.dp))

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Average what FSDP2 did not (`sync_replicated_grads`), then clip to the global gradient norm.
        dp alone: torch's clip_grad_norm_ on the DTensor gradients. tp / ep (alone or under FSDP): each
        parameter's squares summed over the ranks holding distinct parts of it (in rank order: the plan's
        FSDP-sharded slices over every rank, its slices or FSDP shards alone over their group), whole
        copies counted once, so every rank scales by the same factor."""
        self.sync_replicated_grads(params)
        if not self.model_parallel:
            return full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        from glm5.parallel.group import TorchGroup

        two_d = self.mesh.dp > 1
        groups: dict[str, TorchGroup | None] = {
            "world": TorchGroup(None) if two_d else None,
            "model": TorchGroup(self.model_group),
            "dp": TorchGroup(self.dp_group) if two_d else None,
        }
        sums: dict[str, torch.Tensor] = {}
        grads = []
        for p in params:
            if p.grad is None:
                continue
            g = local(p.grad)
            sliced, fsdp = self._layout(p).shard is not None, isinstance(p.grad, DTensor)
            key = ("world" if fsdp else "model") if sliced else ("dp" if fsdp else "once")
            sums[key] = sums.get(key, torch.zeros(())) + g.float().pow(2).sum()
            grads.append(g)
        total = sums.get("once", torch.zeros(()))
        for key in ("world", "model", "dp"):  # every rank holds all three kinds, so all call them
            if groups[key] is not None:
                total = total + groups[key].all_reduce(sums.get(key, torch.zeros(())))
        total = total.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def mean(self, value: float) -> float:
        """The mean over ranks of a per-rank scalar (for the metrics record)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def max(self, value: float | None) -> float | None:
        if value is None:
            return None
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def full(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank calls it); a plain tensor as is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def local(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as is."""
    return x.to_local() if isinstance(x, DTensor) else x


def _like(full_value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full_value` (the same on every rank) laid out as the DTensor `ref`: each rank keeps its own shard,
    nothing is sent."""
    if not isinstance(ref, DTensor):
        return full_value
    return distribute_tensor(full_value, ref.device_mesh, ref.placements, src_data_rank=None)


class DistBalancer(ExpertBalancer):
    """ExpertBalancer on a sharded model: the bias moves on the load summed over the dp ranks (`group`;
    float64 token counts: exact in any order), so every rank and a 1-process run over the same batch
    agree."""

    def __init__(
        self, model: torch.nn.Module, gamma: float = 1e-3, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(model, gamma)
        self.group = group

    @torch.no_grad()
    def update(self, apply: bool = True) -> float:
        for load in self.load:
            dist.all_reduce(load, group=self.group)
        viol = []
        for r, load in zip(self.routers, self.load, strict=True):
            if load.sum() == 0:
                continue
            mean = load.mean()
            viol.append(float(load.max() / mean - 1))
            if apply and self.gamma:
                bias = r.e_score_correction_bias
                sign = torch.sign(mean - load).to(dtype=bias.dtype, device=local(bias).device)
                bias.add_(self.gamma * _like(sign, bias))
            load.zero_()
        return sum(viol) / len(viol) if viol else 0.0


def state_bytes(model: torch.nn.Module, optimizers: list) -> int:
    """Bytes this rank holds of parameters and optimizer state (its shards only)."""
    n = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for o in optimizers:
        for st in o.state.values():
            n += sum(local(v).numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n
