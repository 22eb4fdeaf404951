"""Pipeline-parallel training of a GLM5ForCausalLM with torch.distributed.pipelining (issue 24).

The model is cut into stages from outside the model file: each stage module holds references to the
model's own submodules (no copies) and runs the same ops, in the same order, as `lm_and_mtp` does on
one micro-batch, so a stage's gradients are bitwise those of the 1-process run over the same
micro-batches (tests/glm5/train/test_pipeline.py).

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

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from glm5.model import GLM5ForCausalLM
from glm5.parallel.group import TorchGroup
from glm5.train.dsa import AttentionProbe
from glm5.train.losses import shifted

#: schedule name (as `--pp-schedule` takes it) -> torch.distributed.pipelining class
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
MTP_STAGES = ("last", "own")
LOSS_STAGES = ("sparse", "warmup")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: decoder layers [start, stop) and what else it holds."""

    index: int
    start: int
    stop: int
    first: bool  # embed_tokens (and the MTP inputs)
    final_norm: bool  # ends in the model's final norm
    output: bool  # lm_head, the LM loss, the MTP layer and its loss
    recv_topk: bool  # its first layer is 'shared': it receives the previous full layer's top-k
    send_topk: bool


def plan_stages(
    model: GLM5ForCausalLM, n_stages: int, mtp_stage: str = "last", layers: list[int] | None = None
) -> list[StageSpec]:
    """The stages of `model`: decoder layers split as evenly as they go (earlier stages take the extra
    layer), or `layers[i]` decoder layers on decoder stage i."""
    cfg = model.config
    if mtp_stage not in MTP_STAGES:
        raise ValueError(f"mtp_stage: expected one of {MTP_STAGES}, got {mtp_stage!r}")
    own = mtp_stage == "own"
    n_dec = n_stages - own
    n_layers = cfg.num_hidden_layers
    if own and cfg.num_nextn_predict_layers < 1:
        raise ValueError("mtp_stage: 'own' needs an MTP layer (the config has num_nextn_predict_layers=0)")
    if not 1 <= n_dec <= n_layers:
        raise ValueError(
            f"stages: expected 1..{n_layers + own} for {n_layers} decoder layers with mtp_stage="
            f"{mtp_stage!r}, got {n_stages}"
        )
    if layers is None:
        layers = [n_layers // n_dec + (i < n_layers % n_dec) for i in range(n_dec)]
    if len(layers) != n_dec or any(n < 1 for n in layers) or sum(layers) != n_layers:
        raise ValueError(
            f"layers: expected {n_dec} counts >= 1 summing to {n_layers} (one per decoder stage), "
            f"got {layers}"
        )
    bounds = [0]
    for n in layers:
        bounds.append(bounds[-1] + n)
    shared = [t == "shared" for t in cfg.indexer_types] + [False]  # past the last layer: nothing shared
    specs = []
    for i in range(n_stages):
        start, stop = (bounds[i], bounds[i + 1]) if i < n_dec else (n_layers, n_layers)
        specs.append(
            StageSpec(
                index=i,
                start=start,
                stop=stop,
                first=i == 0,
                final_norm=i == n_dec - 1,
                output=i == n_stages - 1,
                recv_topk=i > 0 and shared[start],
                send_topk=i < n_stages - 1 and shared[stop],
            )
        )
    return specs


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
    ) -> None:
        super().__init__()
        self.spec, self.mtp_steps = spec, mtp_steps
        # the probe is not a module: a plain attribute keeps it out of the parameters
        self.__dict__["_model"] = model
        self.__dict__["_probe"] = probe
        self.kl = probe is not None and probe.stage is not None
        inner = model.model
        self.embed_tokens = inner.embed_tokens if spec.first else None
        self.layers = nn.ModuleList(inner.layers[spec.start : spec.stop])
        self.norm = inner.norm if spec.final_norm else None
        n_main = model.config.num_hidden_layers
        self.mtp = nn.ModuleList(inner.layers[n_main:]) if spec.output and mtp_steps else nn.ModuleList()
        self.lm_head = model.lm_head if spec.output else None

    def forward(self, *received: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
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
        # as glm5.train.losses.mtp_hidden: the tokens j ahead, zero embedding at position 0
        tokens, _ = shifted(ids, j)
        emb = self.embed_tokens(tokens.reshape(-1))
        return emb.masked_fill((step.slots.positions == 0)[:, None], 0.0)

    def _losses(self, hidden: torch.Tensor, mtp_in: list[torch.Tensor], ids: torch.Tensor, step):
        """As `lm_and_mtp` on the main model's normed hidden [T, D]."""
        b, s = ids.shape
        h = hidden.view(b, s, -1)
        lm = self._head_loss(h[:, :-1].reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1))
        if not self.mtp_steps:
            return lm, None
        terms = []
        for j in range(1, self.mtp_steps + 1):
            layer = self.mtp[min(j - 1, len(self.mtp) - 1)]
            _, targets = shifted(ids, j)
            x = layer.predict(mtp_in[j - 1], h.reshape(b * s, -1), step)
            terms.append(self._head_loss(layer.shared_head.norm(x), targets.reshape(-1)))
            h = x.view_as(h)
        return lm, torch.stack(terms).mean()

    def _head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the head's own loss where it has one (a vocabulary-parallel head replaces it with the head)
        head, backend = self.lm_head, self._model.backend
        if hasattr(head, "loss"):
            return head.loss(h, targets, backend)
        return backend.linear_cross_entropy(h, head.weight, targets)

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
    ) -> None:
        self.model, self.stages, self.schedule = model, stages, schedule
        self.group, self.n_microbatches = group, n_microbatches
        self.config = model.config
        self.has_output = any(m.spec.output for m in stages)
        self.parts: dict[str, float | None] = {}

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
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every stage's gradients by the norm over the whole model (the squares summed over the
        pipeline group in rank order); returns that norm, the same on every rank. Within rounding of
        `torch.nn.utils.clip_grad_norm_` on the whole model (the sum's order differs)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64)
        for g in grads:
            local += torch.linalg.vector_norm(g.double()) ** 2
        total = math.sqrt(float(TorchGroup(self.group).all_reduce(local.reshape(1)).item()))
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return total


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
) -> Pipeline:
    """Cut `model` (the whole model, on every rank of `group`) into pipeline stages and return this
    rank's `Pipeline`. `group`: the pipeline dimension's process group (a DeviceMesh's
    `mesh.get_group("pp")`; None: the default group). `schedule`: one of SCHEDULES; 'interleaved-1f1b'
    puts `stages_per_rank` (default 2) stages on each rank, stage i on rank i % size. The loss options
    are the training loop's (`TrainConfig`): with `probe` (its stage set) the indexer KL joins the loss
    as in the loop's stage `loss_stage`."""
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
    v = (stages_per_rank or 2) if multi else 1
    if not multi and stages_per_rank not in (None, 1):
        raise ValueError(f"stages_per_rank: {schedule!r} runs one stage per rank, got {stages_per_rank}")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    specs = plan_stages(model, size * v, mtp_stage, layers)
    modules = [StageModule(model, specs[rank + k * size], mtp_steps, probe) for k in range(v)]
    device = model.backend.device
    pp_stages = [PipelineStage(m, m.spec.index, len(specs), device, group=group) for m in modules]
    kl_on = probe is not None and probe.stage is not None
    loss_fn = _Loss(
        n_microbatches, loss_stage, mtp_weight if mtp_steps else None, kl_weight if kl_on else None
    )
    run = (
        cls(pp_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        if multi
        else cls(pp_stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    )
    return Pipeline(model, modules, run, group, n_microbatches)
