"""Pipeline-parallel training of a GLM5ForCausalLM with torch.distributed.pipelining (issue 24).

The model is cut into stages from outside the model file: each stage module holds references to the
model's own submodules (no copies) and runs the same ops, in the same order, as `lm_and_mtp` does on
one micro-batch, so a stage's gradients are bitwise those of the 1-process run over the same
micro-batches (tests/glm5/train/distributed/test_pipeline.py).

Stages, in order: the first holds `embed_tokens`; each holds a contiguous run of decoder layers; the
output stage holds `lm_head`, the LM loss (the backend's
`linear_cross_entropy`) and the MTP layer with its loss. `mtp_stage="last"` puts the MTP layer with the
last decoder layers; `mtp_stage="own"` gives it, `lm_head` and both losses a stage of their own (the
decoder layers then fill the other stages, the last of them ending in the final norm).

What crosses a stage boundary (besides the residual stream):
- the top-k of the last full layer, int32 [T, index_topk], when the next stage starts with a 'shared'
  layer (it reuses that top-k); any cut is allowed, the tensor travels only where it is needed;
- the MTP inputs: the embedding of the tokens one ahead (zero at position 0, as `mtp_hidden` forms it),
  computed on the first stage, where the embedding lives, and carried to the MTP stage; its gradient
  comes back through the pipeline, so the embedding has one copy and one gradient. `lm_head` lives only
  on the output stage, so the MTP head needs nothing else;
- with an `AttentionProbe` whose stage is set, the indexer KL terms of the layers so far (fp32 [n]),
  so the last stage's `mean` is the loop's `torch.stack(terms).mean()`.

Loss per micro-batch: (lm + mtp_weight * mtp [+ kl_weight * kl]) / n_microbatches (stage 'warmup':
kl_weight * kl / n), so the sum over micro-batches is the 1-process loop's batch-mean loss; gradients
accumulate over micro-batches in micro-batch order (the schedules' `scale_grads` is off).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleGPipe,
    ScheduleLoopedBFS,
)

from glm5.core.model import GLM5ForCausalLM
from glm5.train.distributed.pipeline.stages import SCHEDULES, StageSpec, pipeline_part, rank_stages
from glm5.train.loop.dsa import AttentionProbe, ExpertBalancer
from glm5.train.loop.losses import shifted

LOSS_STAGES = ("sparse", "warmup")


class StageModule(nn.Module):
    """The part of a GLM5ForCausalLM one pipeline stage runs: forward(*received, ids=ids [b, S]) ->
    what the next stage receives (a tuple of tensors), or on the output stage fp32 [3] = (lm, mtp, kl)
    means over this micro-batch (0 where a term is off)."""

    def __init__(
        self,
        model: GLM5ForCausalLM,
        spec: StageSpec,
        mtp_steps: int,
        probe: AttentionProbe | None,
        balancer: ExpertBalancer | None = None,
    ) -> None:
        super().__init__()
        self.spec, self.mtp_steps = spec, mtp_steps
        # the probe is not a module: a plain attribute keeps it out of the parameters
        self.__dict__["_model"] = model
        self.__dict__["_probe"] = probe
        self.__dict__["_balancer"] = balancer
        self._ran = False
        self.kl = probe is not None and probe.stage is not None
        inner = model.model
        self.embed_tokens = inner.embed_tokens if spec.first else None
        self.layers = nn.ModuleList(inner.layers[spec.start : spec.stop])
        self.norm = inner.norm if spec.final_norm else None
        n_main = model.config.num_hidden_layers
        self.mtp = nn.ModuleList(inner.layers[n_main:]) if spec.output and mtp_steps else nn.ModuleList()
        self.lm_head = model.lm_head if spec.output else None

    def forward(self, *received: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        if self._ran:
            return self._forward(*received, ids=ids)
        # the schedule's first call is its metadata pass (on uninitialised inputs past the first stage):
        # what it records in the probe and the balancer is not the step's
        self._ran = True
        probe, balancer = self._probe, self._balancer
        marks = (len(probe.max_logits), len(probe.kl_terms)) if probe is not None else None
        loads = [load.clone() for load in balancer.load] if balancer is not None else None
        out = self._forward(*received, ids=ids)
        if marks is not None:
            del probe.max_logits[marks[0] :], probe.kl_terms[marks[1] :]
        if loads is not None:
            for load, saved in zip(balancer.load, loads, strict=True):
                load.copy_(saved)
        return out

    def _forward(self, *received: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        model, spec = self._model, self.spec
        b, s = ids.shape
        step = model.begin_step([s] * b, None)
        got = list(received)
        kl_before = len(self._probe.kl_terms) if self.kl else 0
        if spec.first:
            x = self.embed_tokens(ids.reshape(-1))
            topk = None
            mtp_in = [self._mtp_embedding(ids, j, step) for j in range(1, self.mtp_steps + 1)]
            kl_in = None
        else:
            x = got.pop(0)
            topk = got.pop(0) if spec.recv_topk else None
            mtp_in = [got.pop(0) for _ in range(self.mtp_steps)]
            kl_in = got.pop(0) if self.kl else None
        for layer in self.layers:
            x, topk = layer(x, step, topk)
        if self.norm is not None:
            x = self.norm(x)
        if spec.output:
            lm, mtp = self._losses(x, mtp_in, ids, step)
        kl = self._kl(kl_in, kl_before)
        if not spec.output:
            out = [x] + ([topk] if spec.send_topk else []) + mtp_in + ([kl] if kl is not None else [])
            return tuple(out)
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return torch.stack([lm, zero if mtp is None else mtp, zero if kl is None else kl.mean()])

    def _mtp_embedding(self, ids: torch.Tensor, j: int, step) -> torch.Tensor:
        # as glm5.train.loop.losses.mtp_hidden: the tokens j ahead, zero embedding at position 0
        tokens, _ = shifted(ids, j)
        emb = self.embed_tokens(tokens.reshape(-1))
        return emb.masked_fill((step.slots.positions == 0)[:, None], 0.0)

    def _losses(self, hidden: torch.Tensor, mtp_in: list[torch.Tensor], ids: torch.Tensor, step):
        """As `lm_and_mtp` on the main model's normed hidden [T, D]."""
        b, s = ids.shape
        h = hidden.view(b, s, -1)
        lm = self._head_loss(h[:, :-1].reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1), step)
        if not self.mtp_steps:
            return lm, None
        terms = []
        for j in range(1, self.mtp_steps + 1):
            layer = self.mtp[min(j - 1, len(self.mtp) - 1)]
            _, targets = shifted(ids, j)
            x = layer.predict(mtp_in[j - 1], h.reshape(b * s, -1), step)
            terms.append(self._head_loss(layer.shared_head.norm(x), targets.reshape(-1), step))
            h = x.view_as(h)
        return lm, torch.stack(terms).mean()

    def _head_loss(self, h: torch.Tensor, targets: torch.Tensor, step) -> torch.Tensor:
        # the head's own loss where it has one (a vocabulary-parallel head replaces it with the head)
        head = self.lm_head
        if hasattr(head, "loss"):
            return head.loss(h, targets, step)
        return step.backend.linear_cross_entropy(h, head.weight, targets)

    def _kl(self, kl_in: torch.Tensor | None, before: int) -> torch.Tensor | None:
        if not self.kl:
            return None
        new = self._probe.kl_terms[before:]
        parts = ([kl_in] if kl_in is not None else []) + ([torch.stack(new)] if new else [])
        if not parts:
            raise ValueError("stages: the first stage has no layer with an indexer to start the KL terms")
        return torch.cat(parts)


class Pipeline:
    """This rank's stage(s) of a pipeline-parallel GLM-5 and the schedule that runs them.

    `step(ids)` runs one batch [B, S] (every rank passes the same ids) as `n_microbatches` micro-batches
    and leaves the gradients of this rank's stage parameters accumulated (call `zero_grad` between
    steps, or the optimizers' own); it returns the batch loss (the sum of the micro-batch losses, each
    divided by n_microbatches) on the rank holding the output stage, None elsewhere. `parts` then holds
    the batch-mean lm / mtp / kl terms there.
    """

    def __init__(
        self,
        model: GLM5ForCausalLM,
        stages: list[StageModule],
        schedule: torch.distributed.pipelining.schedules._PipelineSchedule,
        group: dist.ProcessGroup | None,
        n_microbatches: int,
        n_stages: int | None = None,
    ) -> None:
        self.model, self.stages, self.schedule = model, stages, schedule
        self.group, self.n_microbatches = group, n_microbatches
        self.n_stages = n_stages or dist.get_world_size(group) * len(stages)
        self.config = model.config
        self.has_output = any(m.spec.output for m in stages)
        self.parts: dict[str, float | None] = {}
        self._eval: torch.distributed.pipelining.schedules._PipelineSchedule | None = None

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stage parameters under their names in the model (what an optimizer of this rank
        steps: `build_optimizers(pipeline, ...)` takes it in place of the model)."""
        mine = {id(p) for m in self.stages for p in m.parameters()}
        seen: set[int] = set()
        for name, p in self.model.named_parameters():
            if id(p) in mine and id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def step(self, ids: torch.Tensor) -> torch.Tensor | None:
        if ids.dim() != 2 or ids.shape[0] % self.n_microbatches:
            raise ValueError(
                f"ids: expected [B, S] with B divisible by n_microbatches={self.n_microbatches}, got shape "
                f"{tuple(ids.shape)}"
            )
        self.model.train()
        losses: list[torch.Tensor] = []
        target = ids if self.has_output else None
        outputs = self.schedule.step(ids=ids, target=target, losses=losses)
        if not self.has_output:
            self.parts = {}
            return None
        total = losses[0].detach()
        for loss in losses[1:]:
            total = total + loss.detach()
        # the output stage's (lm, mtp, kl) of every micro-batch, concatenated by the schedule
        mean = outputs.detach().view(self.n_microbatches, 3).sum(0) / self.n_microbatches
        lm, mtp, kl = (float(v) for v in mean)
        mtp_on = any(m.mtp_steps for m in self.stages)
        kl_on = any(m.kl for m in self.stages)
        self.parts = {"lm": lm, "mtp": mtp if mtp_on else None, "kl": kl if kl_on else None}
        return total

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, order: dict[str, int] | None = None) -> torch.Tensor:
        """Clip every stage's gradients by the norm over the whole model; returns that norm, the same on
        every rank. The per-parameter norms of all ranks are gathered and combined in the whole model's
        parameter order (`order`: name -> position; default: the model's, or the whole model's when it
        holds only this rank's stages) as `torch.nn.utils.clip_grad_norm_(..., foreach=False)` combines
        them on the whole model: the same norm and coefficient, bit for bit."""
        if order is None:
            part = pipeline_part(self.model)
            names = part.order if part is not None else [name for name, _ in self.model.named_parameters()]
            order = {name: i for i, name in enumerate(names)}
        mine = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        local = [(order[name], g.dtype, torch.linalg.vector_norm(g, 2)) for name, g in mine]
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, local, group=self.group)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # torch groups the norms by dtype, in order
        for _, dtype, norm in sorted((x for part in gathered for x in part), key=lambda x: x[0]):
            by_dtype.setdefault(dtype, []).append(norm)
        norms = [n for group in by_dtype.values() for n in group]
        if not norms:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(norms), 2)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, g in mine:
            g.mul_(coef.to(g.device))
        return total

    @torch.no_grad()
    def eval_loss(self, ids: torch.Tensor) -> float | None:
        """The next-token loss of the batch ids [B, S] (every rank passes it) as the whole model's
        `model(ids, labels=ids).loss` computes it (one micro-batch, no MTP, no probe), on the output
        stage's rank; None elsewhere. The forward-only schedule is built on the first call."""
        if self._eval is None:
            modules = [StageModule(self.model, m.spec, 0, None) for m in self.stages]
            device = self.model.backend.device
            pp = [PipelineStage(m, m.spec.index, self.n_stages, device, group=self.group) for m in modules]
            self._eval = ScheduleLoopedBFS(pp, 1) if len(pp) > 1 else ScheduleGPipe(pp[0], 1)
        self.model.eval()
        out = self._eval.step(ids=ids)
        return float(out[0]) if self.has_output else None


@dataclass
class _Loss:
    """The schedule's loss_fn: one micro-batch's (lm, mtp, kl) -> its share of the batch loss."""

    n: int
    loss_stage: str
    mtp_weight: float | None  # None: no MTP term
    kl_weight: float | None  # None: no KL term

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        lm, mtp, kl = out[0], out[1], out[2]
        if self.loss_stage == "warmup":
            total = self.kl_weight * kl
        else:
            total = lm
            if self.mtp_weight is not None:
                total = total + self.mtp_weight * mtp
            if self.kl_weight is not None:
                total = total + self.kl_weight * kl
        return total / self.n


def build_pipeline(
    model: GLM5ForCausalLM,
    group: dist.ProcessGroup | None = None,
    schedule: str = "1f1b",
    n_microbatches: int = 2,
    mtp_stage: str = "last",
    *,
    mtp_steps: int = 1,
    mtp_weight: float = 0.3,
    kl_weight: float = 1.0,
    probe: AttentionProbe | None = None,
    loss_stage: str = "sparse",
    stages_per_rank: int | None = None,
    layers: list[int] | None = None,
    balancer: ExpertBalancer | None = None,
) -> Pipeline:
    """Cut `model` (the whole model, on every rank of `group`) into pipeline stages and return this
    rank's `Pipeline`. `group`: the pipeline dimension's process group (a DeviceMesh's
    `mesh.get_group("pp")`; None: the default group). `schedule`: one of SCHEDULES; 'interleaved-1f1b'
    puts `stages_per_rank` (default 2) stages on each rank, stage i on rank i % size. The loss options
    are the training loop's (`TrainConfig`): with `probe` (its stage set) the indexer KL joins the loss
    as in the loop's stage `loss_stage`. What the schedule's metadata pass (its first forward) records in
    `probe` and `balancer` is dropped.

    `model` may hold only this rank's stages (`release_other_stages`); the rest are never touched."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {tuple(SCHEDULES)}, got {schedule!r}")
    if loss_stage not in LOSS_STAGES:
        raise ValueError(f"loss_stage: expected one of {LOSS_STAGES}, got {loss_stage!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches: expected an integer >= 1, got {n_microbatches!r}")
    if mtp_steps > 0 and model.config.num_nextn_predict_layers < 1:
        raise ValueError("mtp_steps: the config has no MTP layer (num_nextn_predict_layers=0)")
    if loss_stage == "warmup" and (probe is None or probe.stage != "warmup"):
        raise ValueError(
            "loss_stage: 'warmup' trains on the indexer KL alone: pass probe=AttentionProbe(model, 'warmup')"
        )
    cls = SCHEDULES[schedule]
    multi = issubclass(cls, PipelineScheduleMulti)
    specs = rank_stages(model, group, schedule, mtp_stage, stages_per_rank, layers)
    modules = [StageModule(model, spec, mtp_steps, probe, balancer) for spec in specs]
    device = model.backend.device
    n_stages = dist.get_world_size(group) * len(specs)
    pp_stages = [PipelineStage(m, m.spec.index, n_stages, device, group=group) for m in modules]
    kl_on = probe is not None and probe.stage is not None
    loss_fn = _Loss(
        n_microbatches, loss_stage, mtp_weight if mtp_steps else None, kl_weight if kl_on else None
    )
    run = (
        cls(pp_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        if multi
        else cls(pp_stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    )
    return Pipeline(model, modules, run, group, n_microbatches, n_stages)
