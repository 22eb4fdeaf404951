"""`glm5 train --nproc N --mesh pp=N`: the training loop's step, evaluation and checkpoints through the
pipeline of glm5/train/distributed/pipeline/schedule.py.

- `PipelineDist` (a `Dist` the Trainer holds as `dist`): after the process group starts, each rank
  drops the modules of the other ranks' stages (`release_other_stages`), so it holds and steps only its
  own parameters and optimizer state. The pipeline itself is built on the first step or evaluation,
  with the Trainer's probe and expert balancer.
- `pipeline_step`: the loop's step (stages 'sparse' and 'warmup'): every rank passes the same global
  batch, cut into `--microbatches` micro-batches; the gradients are clipped by the norm over every
  stage, combined in the whole model's parameter order as torch's `clip_grad_norm_` combines them.
- The metrics record: the losses come from the output stage's rank (the last), broadcast to every rank
  (rank 0 writes it, as in every distributed run); the largest attention logit is the maximum over the
  pipeline, and the expert balancer's violation the mean over every router of the model, in the model's
  order (each rank moves the biases of its own routers). `param_bytes` / `state_bytes`: per rank.
- `pipeline_evaluate`: the held-out loss through a forward-only schedule (one micro-batch), the number
  `model(ids, labels=ids).loss` gives on the whole model.
- Checkpoints: as every distributed run's (glm5/train/distributed/checkpoint.py); each rank saves its
parameters,
  and the optimizer metadata (`merged_optimizer_meta`) lists every rank's parameters in the whole
  model's order, so the checkpoint loads on one process like any other.

With `--microbatches 1` and GPipe, a pp run is bitwise the 1-process run (tests/glm5/train/
test_pipeline_cli.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from glm5.core.config import GLM5Config
from glm5.train.distributed.mesh import Mesh
from glm5.train.distributed.pipeline.schedule import Pipeline, build_pipeline
from glm5.train.distributed.pipeline.stages import (
    MTP_STAGES,
    SCHEDULES,
    pipeline_part,
    plan_stages,
    rank_stages,
    release_other_stages,
    stages_per_rank_of,
)
from glm5.train.distributed.runtime import Dist, local
from glm5.train.loop.dsa import ExpertBalancer
from glm5.train.muon.optimizer import build_optimizers


def check_pipeline_options(
    config: GLM5Config, pp: int, schedule: str, mtp_stage: str, microbatches: int, batch_size: int
) -> tuple[str, str] | None:
    """(option, what is wrong) for pipeline options that cannot run, None when they can."""
    if schedule not in SCHEDULES:
        return "--pp-schedule", f"expected one of {', '.join(SCHEDULES)}, got {schedule!r}"
    if mtp_stage not in MTP_STAGES:
        return "--mtp-stage", f"expected one of {', '.join(MTP_STAGES)}, got {mtp_stage!r}"
    if mtp_stage == "own" and config.num_nextn_predict_layers < 1:
        return "--mtp-stage", "'own' needs an MTP layer (the config has num_nextn_predict_layers=0)"
    if microbatches < 1 or batch_size % microbatches:
        return "--microbatches", f"expected a divisor of --batch-size ({batch_size}), got {microbatches}"
    if schedule == "1f1b" and microbatches < pp:
        return "--microbatches", f"1f1b needs at least one micro-batch per stage ({pp}), got {microbatches}"
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved-1f1b" and microbatches % rounds:
        return "--microbatches", (
            f"interleaved-1f1b needs a multiple of pp ({pp}) or fewer than 2 * pp, got {microbatches}"
        )
    try:
        plan_stages(config, pp * stages_per_rank_of(schedule), mtp_stage)
    except ValueError as exc:
        return "--mesh", f"pp={pp} with {schedule}: {exc}"
    return None


class PipelineBalancer(ExpertBalancer):
    """The expert balancer of one pipeline rank: it moves the biases of the routers it holds, and reports
    the mean violation over every router of the model in the model's order (what one process reports)."""

    def __init__(self, model: torch.nn.Module, gamma: float, group: dist.ProcessGroup | None) -> None:
        super().__init__(model, gamma)
        self.group = group
        layer_of = {}
        for i, layer in enumerate(model.model.layers):
            for m in layer.modules():
                layer_of[id(m)] = i
        self.keys = [(layer_of.get(id(r), -1), k) for k, r in enumerate(self.routers)]

    @torch.no_grad()
    def update(self, apply: bool = True) -> float:
        mine = []
        for key, r, load in zip(self.keys, self.routers, self.load, strict=True):
            if load.sum() == 0:
                continue
            mean = load.mean()
            mine.append((key, float(load.max() / mean - 1)))
            if apply and self.gamma:
                sign = torch.sign(mean - load).to(r.e_score_correction_bias)
                r.e_score_correction_bias.add_(self.gamma * sign)
            load.zero_()
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        viol = [v for _, v in sorted(x for part in every for x in part)]
        return sum(viol) / len(viol) if viol else 0.0


class PipelineDist(Dist):
    """One rank of a pipeline-parallel run (`--mesh pp=N`): its stages' modules only."""

    cfg: Any = None
    pipe: Pipeline | None = None

    @classmethod
    def for_pipeline(
        cls, mesh: Mesh, cfg: Any, model: torch.nn.Module, plain_checkpoint=None
    ) -> PipelineDist:
        """Join the process group and drop the other ranks' stages from `model` (`cfg`: the TrainConfig)."""
        if plain_checkpoint is not None:
            raise ValueError(
                f"resume: {plain_checkpoint} was written by a 1-process run; resume it without --nproc"
            )
        if cfg.stage == "rl":
            raise ValueError("stage: rl with pp > 1 is not in this build yet (use --mesh dp=N, tp=N or ep=N)")
        problem = check_pipeline_options(
            model.config, mesh.pp, cfg.pp_schedule, cfg.mtp_stage, cfg.microbatches, cfg.batch_size
        )
        if problem is not None:
            raise ValueError(f"{problem[0].lstrip('-').replace('-', '_')}: {problem[1]}")
        d = cls.setup(mesh, 3, model.backend.device)
        d.cfg = cfg
        d.shard(model)
        return d

    @property
    def group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group(0)

    @property
    def output_rank(self) -> int:
        """The global rank holding the output stage (the last stage is on the group's last rank)."""
        return dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1)

    def shard(self, model: torch.nn.Module, frozen_base: bool = False) -> None:
        specs = rank_stages(model, self.group, self.cfg.pp_schedule, self.cfg.mtp_stage)
        release_other_stages(model, specs)

    @property
    def model_parallel(self) -> bool:
        """The model is split (by stages), not sharded by FSDP."""
        return True

    @property
    def plan_mesh(self) -> None:
        return None  # every parameter a rank holds is whole

    def optimizers(self, model: torch.nn.Module, mode: str, lr: float, weight_decay: float) -> list:
        """[Muon, AdamW] over this rank's parameters: each matrix is whole on one rank."""
        return build_optimizers(model, mode, lr, weight_decay)

    def balancer(self, model: torch.nn.Module, gamma: float) -> ExpertBalancer:
        return PipelineBalancer(model, gamma, self.group)

    def pipeline(self, trainer) -> Pipeline:
        """This rank's Pipeline, built on the first call with the Trainer's probe and balancer."""
        if self.pipe is None:
            cfg = self.cfg
            self.pipe = build_pipeline(
                trainer.model,
                self.group,
                cfg.pp_schedule,
                cfg.microbatches,
                cfg.mtp_stage,
                mtp_steps=cfg.mtp_steps,
                mtp_weight=cfg.mtp_weight,
                kl_weight=cfg.kl_weight,
                probe=trainer.probe,
                loss_stage=cfg.stage,
                balancer=trainer.balancer,
            )
        return self.pipe

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.pipe.clip_grad_norm_(max_norm)

    def global_record(self, rec: dict) -> dict:
        """The step's record on every rank: the losses the output rank computed, the largest logit and the
        bytes each rank holds."""
        box = [{k: rec[k] for k in ("loss", "lm_loss", "mtp_loss", "kl_loss")}]
        dist.broadcast_object_list(box, src=self.output_rank, group=self.group)
        rec.update(box[0])
        logit = rec["max_attn_logit"]
        top = self.max(float("-inf") if logit is None else logit)
        rec["max_attn_logit"] = None if top == float("-inf") else top
        return rec

    def bytes_per_rank(self, model: torch.nn.Module, optimizers: list) -> dict[str, list[int]]:
        """Parameter bytes and parameter + optimizer-state bytes of every rank (rank order)."""
        from glm5.train.distributed.runtime import state_bytes

        mine = (
            sum(local(p).numel() * p.element_size() for p in model.parameters()),
            state_bytes(model, optimizers),
        )
        every: list = [None] * self.world
        dist.all_gather_object(every, mine)
        return {"param_bytes": [b[0] for b in every], "state_bytes": [b[1] for b in every]}


def pipeline_step(trainer, step: int) -> dict:
    """One optimizer step of the Trainer through the pipeline; the metrics record, the same on every rank."""
    cfg, d = trainer.cfg, trainer.dist
    t0 = time.perf_counter()
    ids = trainer.corpus.batch(cfg.batch_size, cfg.seq_len, cfg.seed, step).to(trainer.device)
    pipe = d.pipeline(trainer)
    trainer.probe.reset()
    trainer.probe.active = trainer.balancer.active = True
    lr = cfg.lr_at(step)
    for o in trainer.optimizers:
        for g in o.param_groups:
            g["lr"] = lr
    total = pipe.step(ids)
    gnorm = d.clip_grad_norm(trainer.params, cfg.grad_clip)
    for o in trainer.optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    violation = trainer.balancer.update()
    parts = pipe.parts
    rec = {
        "step": step + 1,
        "loss": None if total is None else float(total),
        "lm_loss": parts.get("lm"),
        "mtp_loss": parts.get("mtp"),
        "kl_loss": parts.get("kl"),
        "lr": lr,
        "grad_norm": float(gnorm),
        "max_attn_logit": max(trainer.probe.max_logits) if trainer.probe.max_logits else None,
        "moe_max_violation": violation,
        "tokens": (step + 1) * cfg.batch_size * cfg.seq_len,
        "step_s": time.perf_counter() - t0,
    }
    rec = d.global_record(rec)
    rec.update(d.bytes_per_rank(trainer.model, trainer.optimizers))
    return rec


@torch.no_grad()
def pipeline_evaluate(trainer) -> float:
    """The mean held-out loss over the Trainer's fixed batches, through the pipeline, on every rank."""
    d = trainer.dist
    pipe = d.pipeline(trainer)
    trainer.probe.active = trainer.balancer.active = False
    losses = [pipe.eval_loss(b.to(trainer.device)) for b in trainer.heldout]
    box = [sum(losses) / len(losses) if pipe.has_output else None]
    dist.broadcast_object_list(box, src=d.output_rank, group=d.group)
    return box[0]


def merged_optimizer_meta(model: torch.nn.Module, meta: dict) -> dict:
    """The optimizer metadata (`{'state', 'param_groups'}` with parameter names) of the whole pipeline:
    every rank's, its groups matched by their options and their parameters in the whole model's order.
    A collective on pipeline ranks; `meta` as is for a whole model."""
    part = pipeline_part(model)
    if part is None:
        return meta
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, meta)
    position = {name: i for i, name in enumerate(part.order)}
    state: dict = {}
    groups: dict[tuple, dict] = {}
    for m in every:
        state.update(m["state"])
        for g in m["param_groups"]:
            key = tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
            merged = groups.setdefault(key, dict(g, params=[]))
            merged["params"] = merged["params"] + list(g["params"])
    for g in groups.values():
        g["params"] = sorted(g["params"], key=position.__getitem__)
    return {
        "state": dict(sorted(state.items(), key=lambda kv: position[kv[0]])),
        "param_groups": list(groups.values()),
    }
