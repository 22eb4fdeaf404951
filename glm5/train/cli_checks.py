"""The checks `glm5 train` runs on its options before anything is built or written (glm5/train/cli.py):
the run directory, the sequence length against the model, the parallel layout, the pipeline options and
what a resume may change. Each refuses in one line naming the option."""

from __future__ import annotations

import os
from pathlib import Path

import click

from glm5.cli_args import (
    check_positions,
    one_line_errors,
)
from glm5.infra import fsio


def check_sequence_fits(model_path: Path | None, preset: str, tokens: int, hint: str) -> None:
    """Refuse sequences past the model's max_position_embeddings before anything is built (an unbounded
    --seq-len ran out of memory or failed deep inside the data loader)."""
    from glm5.core.checkpoint import read_config
    from glm5.core.config import GLM5Config

    with one_line_errors("'--model'" if model_path is not None else "'--config'"):
        config = (
            GLM5Config.from_dict(read_config(Path(model_path)))
            if model_path is not None
            else GLM5Config.from_preset(preset)
        )
    check_positions(config, tokens, hint, "a training sequence")


def run_dir(out: str, resume: bool) -> Path:
    """--out as a directory that exists: refused if empty, not a directory, not writable, or (a new run)
    holding files that are not a training run's."""
    from glm5.train.loop.trainer import foreign_entries

    if not out.strip():
        raise click.BadParameter("expected a directory path, got an empty string", param_hint="'--out'")
    path = Path(out)
    try:
        if not resume:
            foreign = foreign_entries(path)
            if foreign:
                raise click.BadParameter(
                    f"{path} holds files that are not a training run's ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory",
                    param_hint="'--out'",
                )
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise click.BadParameter(f"{path} exists and is not a directory", param_hint="'--out'") from None
    except OSError as exc:
        raise click.BadParameter(fsio.describe(exc), param_hint="'--out'") from None
    return path


def parallel_options(
    nproc: int, mesh: str | None, stage: str, batch_size: int, layout_invariant: bool = False
):
    """The Mesh of a run on several processes (None for one), checked against --nproc, --stage,
    --batch-size and --layout-invariant in one line naming the option (before any rank starts). Under
    torchrun, --nproc defaults to its WORLD_SIZE."""
    from glm5.train.distributed.mesh import Mesh, check_mesh, parse_mesh
    from glm5.train.distributed.runtime import under_torchrun

    ctx = click.get_current_context()
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if ctx.get_parameter_source("nproc") == click.core.ParameterSource.COMMANDLINE and nproc != world:
            raise click.BadParameter(
                f"torchrun started {world} processes, got {nproc}", param_hint="'--nproc'"
            )
        nproc = world
    try:
        parsed = parse_mesh(mesh) if mesh is not None else Mesh(dp=nproc)
        check_mesh(parsed, nproc)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--mesh'") from None
    if layout_invariant and parsed.tp > 1:
        raise click.BadParameter(
            f"tp={parsed.tp} splits the experts on their intermediate dim, which has no exact split product "
            "in the layout-invariant mode; use ep=N (whole experts per rank), which is invariant",
            param_hint="'--mesh'",
        )
    if nproc == 1:
        return None
    if batch_size % parsed.dp:
        raise click.BadParameter(
            f"the global batch must divide by dp ({parsed.dp}), got {batch_size}", param_hint="'--batch-size'"
        )
    return parsed


def check_plan_fits(parallel, preset: str | None) -> None:
    """Refuse (on '--mesh') a tp / ep split the preset's counts do not divide (experts over ep, heads over
    tp, ...), in the plan's own words, before any rank starts; None (one process, or weights from a
    checkpoint whose config the ranks read) passes."""
    if parallel is None or preset is None or (parallel.tp == 1 and parallel.ep == 1):
        return
    from glm5.core.config import GLM5Config
    from glm5.parallel.plan import PlanError, check

    try:
        check(GLM5Config.from_preset(preset), parallel.tp, parallel.ep)
    except PlanError as exc:
        raise click.BadParameter(f"{parallel}: {exc}", param_hint="'--mesh'") from None


def pipeline_options(
    parallel,
    stage: str,
    batch_size: int,
    microbatches: int | None,
    schedule: str,
    mtp_stage: str,
    source: tuple | None,
) -> int:
    """The micro-batches of a pp run (default: one per stage of the pipeline group, 1 without pp), its
    options checked against the model (`source`: (--model, --config); None on --resume) in one line
    naming the option; the pipeline options without --mesh pp=N are refused."""
    ctx = click.get_current_context()
    pp = parallel.pp if parallel is not None else 1
    if pp == 1:
        for name in ("pp_schedule", "mtp_stage", "microbatches"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.BadParameter(
                    "only with --mesh pp=N (N > 1)", param_hint=f"'--{name.replace('_', '-')}'"
                )
        return 1
    if stage == "rl":
        raise click.BadParameter(
            "rl with pp > 1: not in this build yet (use --mesh dp=N, tp=N or ep=N)", param_hint="'--stage'"
        )
    microbatches = pp if microbatches is None else microbatches
    if source is not None:
        from glm5.core.checkpoint import read_config
        from glm5.core.config import GLM5Config
        from glm5.train.distributed.pipeline.run import check_pipeline_options

        model_path, preset = source
        with one_line_errors("'--model'" if model_path is not None else "'--config'"):
            config = (
                GLM5Config.from_dict(read_config(Path(model_path)))
                if model_path is not None
                else GLM5Config.from_preset(preset)
            )
        problem = check_pipeline_options(config, pp, schedule, mtp_stage, microbatches, batch_size)
        if problem is not None:
            raise click.BadParameter(problem[1], param_hint=f"'{problem[0]}'")
    return microbatches


def check_resumable_sharded(out: Path, resume: bool) -> None:
    """A run on several processes resumes only a sharded checkpoint (a 1-process run's optimizer state is
    not laid out for shards): refused here, before any process starts."""
    from glm5.train.distributed.checkpoint import is_sharded
    from glm5.train.loop.state import latest_checkpoint

    ckpt = latest_checkpoint(out / "checkpoints") if resume else None
    if ckpt is not None and not is_sharded(ckpt):
        raise click.BadParameter(
            f"{ckpt} was written by a 1-process run; resume it without --nproc (or --nproc 1)",
            param_hint="'--resume'",
        )


def check_resume_options(cfg, out: Path) -> None:
    """--resume continues under the run's saved options: an option given on this command line that differs
    from the saved one is refused by name (only --steps may change), never silently ignored."""
    import dataclasses

    from click.core import ParameterSource

    from glm5.train.loop.state import latest_checkpoint, load_trainer_state

    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None:
        return  # the Trainer says there is nothing to resume
    saved = load_trainer_state(ckpt)["config"]
    ctx = click.get_current_context()
    fields = {f.name for f in dataclasses.fields(cfg)}
    for param in ctx.command.params:
        name = {"model_path": "init"}.get(param.name, param.name)
        if name == "steps" or name not in fields or name not in saved:
            continue
        if ctx.get_parameter_source(param.name) != ParameterSource.COMMANDLINE:
            continue
        if getattr(cfg, name) != saved[name]:
            raise click.BadParameter(
                f"the run in {out} was started with {saved[name]!r}; --resume continues under its saved "
                "options (only --steps may change)",
                param_hint=f"'{param.opts[0]}'",
            )


def check_options_used(stage: str, rollout_engine: str, parallel, resume: bool) -> None:
    """An option given on the command line that does nothing in this configuration is refused, naming what
    it needs (it used to be ignored while the run trained). On --resume the saved options decide, and
    check_resume_options refuses any that differ."""
    ctx = click.get_current_context()

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE

    if resume:
        return
    dp = parallel.dp if parallel is not None else 1
    needs = (
        ("rollout_engine", rollout_engine != "sync" and stage != "rl", "--stage rl (it samples rollouts)"),
        ("push_every", rollout_engine == "sync", "a rollout engine (--rollout-engine policy|vllm)"),
        ("max_staleness", rollout_engine == "sync", "a rollout engine (--rollout-engine policy|vllm)"),
        (
            "engine_tp",
            rollout_engine != "vllm",
            "--rollout-engine vllm (the policy engine samples with the trainer's own layout)",
        ),
        ("zero", dp == 1, "data parallelism (--nproc N with dp > 1: FSDP2 shards over the dp ranks)"),
    )
    for name, unused, what in needs:
        if given(name) and unused:
            raise click.BadParameter(
                f"does nothing in this run: only with {what}", param_hint=f"'--{name.replace('_', '-')}'"
            )
