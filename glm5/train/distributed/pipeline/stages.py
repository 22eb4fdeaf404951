"""Where each pipeline stage's layers are (glm5/train/distributed/pipeline/schedule.py runs them): the cut of
a GLM5ForCausalLM into stages, which stages a rank runs, and dropping from a rank's model what other ranks
hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM

#: schedule name (as `--pp-schedule` takes it) -> torch.distributed.pipelining class
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
MTP_STAGES = ("last", "own")


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
    model: GLM5ForCausalLM | GLM5Config,
    n_stages: int,
    mtp_stage: str = "last",
    layers: list[int] | None = None,
) -> list[StageSpec]:
    """The stages of `model` (or of a model of this config): decoder layers split as evenly as they go
    (earlier stages take the extra layer), or `layers[i]` decoder layers on decoder stage i."""
    cfg = model if isinstance(model, GLM5Config) else model.config
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


def stages_per_rank_of(schedule: str, stages_per_rank: int | None = None) -> int:
    """How many stages each rank runs under `schedule` (one, or for interleaved-1f1b `stages_per_rank`,
    default 2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {tuple(SCHEDULES)}, got {schedule!r}")
    multi = issubclass(SCHEDULES[schedule], PipelineScheduleMulti)
    if not multi and stages_per_rank not in (None, 1):
        raise ValueError(f"stages_per_rank: {schedule!r} runs one stage per rank, got {stages_per_rank}")
    return (stages_per_rank or 2) if multi else 1


def rank_stages(
    model: GLM5ForCausalLM | GLM5Config,
    group: dist.ProcessGroup | None,
    schedule: str,
    mtp_stage: str = "last",
    stages_per_rank: int | None = None,
    layers: list[int] | None = None,
) -> list[StageSpec]:
    """The stages this rank of `group` runs: stage i on rank i % size."""
    v = stages_per_rank_of(schedule, stages_per_rank)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    specs = plan_stages(model, size * v, mtp_stage, layers)
    return [specs[rank + k * size] for k in range(v)]


class _Elsewhere(nn.Module):
    """Stands in for a module another pipeline rank holds: no parameters or buffers. `weight` (when the
    module had one) is an empty plain tensor, so its device and dtype stay readable (`begin_step` and
    `GLM5ForCausalLM.dtype` read the embedding's)."""

    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        w = getattr(like, "weight", None)
        if isinstance(w, torch.Tensor):
            self.weight = torch.empty(0, dtype=w.dtype, device=w.device)


@dataclass(frozen=True)
class PipelinePart:
    """What a model that `release_other_stages` cut down is part of (`model.glm5_pipeline`): the whole
    model's parameter names in order, and those other ranks hold."""

    order: tuple[str, ...]
    elsewhere: frozenset[str]


def pipeline_part(model: nn.Module) -> PipelinePart | None:
    """The PipelinePart of a cut-down model, None for a whole one."""
    return getattr(model, "glm5_pipeline", None)


def release_other_stages(model: GLM5ForCausalLM, specs: list[StageSpec]) -> list[str]:
    """Drop from `model`, in place, every module no stage in `specs` (this rank's) holds: decoder layers
    outside them, the embedding off the first stage, the final norm off the stage that ends in it,
    `lm_head` and the MTP layers off the output stage. Parameter names of what stays are unchanged;
    `model.glm5_pipeline` records the whole model's (`PipelinePart`). Returns the names of the
    parameters dropped (held by other ranks)."""
    before = [name for name, _ in model.named_parameters()]
    inner, n_main = model.model, model.config.num_hidden_layers
    output = any(s.output for s in specs)
    for i in range(len(inner.layers)):
        held = any(s.start <= i < s.stop for s in specs) if i < n_main else output
        if not held:
            inner.layers[i] = _Elsewhere(inner.layers[i])
    if not any(s.first for s in specs):
        inner.embed_tokens = _Elsewhere(inner.embed_tokens)
    if not any(s.final_norm for s in specs):
        inner.norm = _Elsewhere(inner.norm)
    if not output:
        model.lm_head = _Elsewhere(model.lm_head)
    kept = {name for name, _ in model.named_parameters()}
    dropped = [name for name in before if name not in kept]
    model.glm5_pipeline = PipelinePart(tuple(before), frozenset(dropped))
    return dropped
