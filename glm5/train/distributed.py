"""`glm5 train --nproc N --mesh dp=N|tp=N|ep=N`: training on N processes with torch.distributed.

- `launch` re-runs the command line (sys.argv) under torchrun's launcher (`elastic_launch`), one
  process per rank; a command already under torchrun (RANK / WORLD_SIZE set) runs as its rank.
- `Dist.setup` starts the process group (gloo on CPU, nccl on CUDA, hccl on Ascend) and the DeviceMesh.
  `Dist.shard` with dp: FSDP2 `fully_shard`, every decoder layer its own unit, the MTP layer,
  embedding, final norm and output head in the root unit (the MTP loss reads `shared_head.norm` and
  `lm_head.weight` after the model's forward returned, so the root keeps them gathered until its
  backward). ZeRO-3 frees each layer's gathered parameters after its forward
  (reshard_after_forward=True), ZeRO-2 keeps them to the backward; gradients and optimizer state are
  sharded either way. With tp or ep: the one parallel plan, glm5/parallel/plan.py.
- Optimizers: `DistributedMuon` (glm5/train/muon_dist.py: per-head and per-expert shards updated in
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

from glm5.train.dsa import ExpertBalancer
from glm5.train.mesh import Mesh
from glm5.train.muon_dist import build_distributed_optimizers

#: set by `launch` for its ranks: the launching process holds the run's lock (pid)
LOCK_HOLDER_ENV = "GLM5_TRAIN_LOCK_PID"
ZERO_STAGES = (2, 3)
_PG_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def under_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(argv: list[str], nproc: int) -> int:
    """Run `glm5 <argv>` on `nproc` local processes under torchrun; the exit code of the first failed
    rank (0 when every rank succeeded). The caller holds the run's lock; its ranks are told so."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun --standalone: a rendezvous on a free local port
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "glm5.cli", *argv)
    except ChildFailedError as exc:
        codes = [f.exitcode for _, f in sorted(exc.failures.items())]
        return next((c for c in codes if c), 1)
    finally:
        os.environ.pop(LOCK_HOLDER_ENV, None)
    return 0


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
        """Join the process group (from torchrun's environment) and build a 1-D DeviceMesh over every
        rank, named after the mesh's one axis above 1."""
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
        dm = init_device_mesh(device.type, (world,), mesh_dim_names=(mesh.axis,))
        return cls(mesh, zero, dm, dist.get_rank(), world)

    @classmethod
    def for_run(
        cls, mesh: Mesh, zero: int, model: torch.nn.Module, batch_size: int, plain_checkpoint=None
    ) -> Dist:
        """`setup` and `shard` for a Trainer, after checking the global batch divides by dp and that it
        does not resume a 1-process checkpoint (`plain_checkpoint`: its optimizer state is not sharded)."""
        if batch_size % mesh.dp:
            raise ValueError(f"batch_size: the global batch ({batch_size}) must divide by dp ({mesh.dp})")
        if plain_checkpoint is not None:
            raise ValueError(f"resume: {plain_checkpoint} was written by a 1-process run; resume it without "
                             "--nproc")
        d = cls.setup(mesh, zero, model.backend.device)
        d.shard(model)
        return d

    def global_record(self, rec: dict) -> dict:
        """A step's metrics record for the global batch: the mean of the ranks' losses, the largest logit."""
        for key in ("loss", "lm_loss", "mtp_loss", "kl_loss"):
            rec[key] = None if rec[key] is None else self.mean(rec[key])
        rec["max_attn_logit"] = self.max(rec["max_attn_logit"])
        return rec

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes metrics, the summary and plots."""
        return self.rank == 0

    @property
    def model_parallel(self) -> bool:
        """tp or ep: the model split by glm5.parallel.plan (not FSDP)."""
        return self.mesh.axis in ("tp", "ep")

    def shard(self, model: torch.nn.Module) -> None:
        """dp: FSDP2 in place, each decoder layer a unit, the rest (MTP layer included) the root unit.
        tp / ep: the one parallel plan (glm5/parallel/plan.py) over the mesh's group."""
        from torch.distributed.fsdp import fully_shard

        if self.model_parallel:
            from glm5.parallel.group import Single, TorchGroup
            from glm5.parallel.plan import apply

            group = TorchGroup(self.device_mesh.get_group(0))
            if self.mesh.axis == "tp":
                apply(model, tp=group)
            else:
                apply(model, tp=Single(), ep=group)
            return

        reshard = self.zero == 3
        # the model returns views (e.g. its loss); nothing here modifies them in place
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        for layer in model.model.layers[: model.config.num_hidden_layers]:
            fully_shard(layer, mesh=self.device_mesh, reshard_after_forward=reshard)
        # the root keeps its parameters gathered after forward: the MTP loss runs after model() returns
        fully_shard(model, mesh=self.device_mesh, reshard_after_forward=False)

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
        """This rank's slice of the global batch [B, S] (B divides by dp: checked by the CLI / Trainer)."""
        per = ids.shape[0] // self.mesh.dp
        if per == ids.shape[0]:
            return ids  # tp / ep: every rank sees the whole batch
        return ids[self.rank * per : (self.rank + 1) * per]

    def optimizers(self, model: torch.nn.Module, mode: str, lr: float, weight_decay: float) -> list:
        """[DistributedMuon, AdamW] over the sharded parameters (glm5/train/muon_dist.py)."""
        return build_distributed_optimizers(model, mode, lr, weight_decay)

    def balancer(self, model: torch.nn.Module, gamma: float) -> ExpertBalancer:
        # tp / ep: the router is replicated, every rank counts the same tokens
        return ExpertBalancer(model, gamma) if self.model_parallel else DistBalancer(model, gamma)

    @property
    def plan_mesh(self) -> DeviceMesh | None:
        """The mesh the plan's slices lie on (for checkpoints), None under FSDP."""
        return self.device_mesh if self.model_parallel else None

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm. FSDP2: torch's clip_grad_norm_ on the DTensor gradients;
        tp / ep: the squares of the plan's slices summed over the group (in rank order), replicated
        parameters counted once, so every rank scales by the same factor."""
        if not self.model_parallel:
            return full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        from glm5.parallel.group import TorchGroup

        grads = [(p.grad, getattr(p, "glm5_shard", None) is not None) for p in params if p.grad is not None]
        sliced = sum((g.float().pow(2).sum() for g, s in grads if s), torch.zeros(()))
        replicated = sum((g.float().pow(2).sum() for g, s in grads if not s), torch.zeros(()))
        total = (TorchGroup(self.device_mesh.get_group(0)).all_reduce(sliced) + replicated).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g, _ in grads:
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
    """ExpertBalancer on a sharded model: the bias moves on the load summed over every rank (float64
    token counts: exact in any order), so every rank and a 1-process run over the same batch agree."""

    @torch.no_grad()
    def update(self, apply: bool = True) -> float:
        for load in self.load:
            dist.all_reduce(load)
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

