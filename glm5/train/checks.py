"""What `glm5 train` checks before it builds or writes anything.

- Its options, on the command line (glm5/train/cli.py): the run directory, the sequence length against the
  model, the parallel layout, the pipeline options and what a resume may change; each refuses in one line
  naming the option (a click usage error).
- The run itself, callable without a process group, so the launcher of `--nproc N` runs it before any rank
  starts and each rank (its Trainer) again: the run directory against --resume, the steps, the trainer
  state and a sharded checkpoint's manifest, and the options a run on several processes refuses.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from glm5.cli_args import check_positions, one_line_errors
from glm5.core.checkpoint import BadCheckpointFile, read_config
from glm5.infra import fsio
from glm5.train.distributed import checkpoint as dist_state
from glm5.train.distributed.manifest import verify
from glm5.train.distributed.mesh import Mesh
from glm5.train.loop.options import TrainConfig
from glm5.train.loop.state import checkpoints, latest_checkpoint, load_trainer_state

#: what a run directory may hold (anything else in --out is not ours: a new run refuses it)
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "loss.png", ".lock")


def foreign_entries(out: Path) -> list[str]:
    """The entries of `out` that are not a training run's (RUN_FILES, and the temporaries of its atomic
    writes)."""
    if not out.is_dir():
        return []
    ours = (*(f".{n}.tmp-" for n in RUN_FILES), ".lock.rank")  # and the ranks' locks (train/ownership.py)
    return sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES and not p.name.startswith(ours))


class RunExists(ValueError):
    """`out` already holds a training run and --resume was not given: nothing is overwritten."""


class NothingToResume(ValueError):
    """--resume, but `out` holds no complete checkpoint."""


class StepsDone(ValueError):
    """--resume with a `steps` the run has already reached: there is nothing to train."""


def check_run(
    cfg: TrainConfig, out: Path, resume: bool, mesh: Mesh | None = None, checksums: bool = True
) -> tuple[Path | None, TrainConfig, dict | None]:
    """What a Trainer checks before it builds anything, callable without a process group (the launcher of
    `glm5 train --nproc N` runs it before any rank starts): RunExists, NothingToResume, StepsDone, a
    sharded checkpoint to resume or start from against its manifest (glm5/train/distributed/manifest.py; the
    files' sha256 with `checksums`), the trainer state, and with `mesh` the options a run on several
    processes refuses (ValueError, one line). -> (the checkpoint to resume or None, the run's options (a
    resume's saved ones, only `steps` from `cfg`), its trainer state or None)."""
    out = Path(out)
    ckpt_root = out / "checkpoints"
    fsio.recover(ckpt_root)  # a checkpoint a killed save set aside is put back first
    if not resume:
        held = existing_run(out)
        if held:
            raise RunExists(
                f"{out} already holds a run ({held}); pass --resume to continue it, or choose another --out"
            )
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    if resume and ckpt is None:
        raise NothingToResume(
            f"no checkpoint to resume under {ckpt_root}"
            + (
                " (the run stopped before its first save: run it again without --resume to start it over)"
                if (out / "metrics.jsonl").exists()
                else ""
            )
        )
    saved = None
    if ckpt is not None:
        if dist_state.is_sharded(ckpt):
            verify(ckpt, trainer=True, checksums=checksums)
            read_config(ckpt)  # what each rank builds its model from: checked here, once
        saved = load_trainer_state(ckpt)
        if cfg.steps <= saved["step"]:
            raise StepsDone(f"must exceed the steps already done ({saved['step']}), got {cfg.steps}")
        try:
            cfg = TrainConfig(**dict(saved["config"], steps=cfg.steps))
        except (TypeError, ValueError) as exc:
            f = ckpt / "trainer" / "trainer_state.json"
            raise BadCheckpointFile(f, f"config: {(str(exc).splitlines() or ['invalid'])[0]}") from None
    if cfg.init and dist_state.is_sharded(cfg.init):
        verify(cfg.init, trainer=False, checksums=checksums)
        read_config(Path(cfg.init))
    if mesh is not None:
        check_rl_on_mesh(cfg, mesh)
    return ckpt, cfg, saved


def check_rl_on_mesh(cfg: TrainConfig, mesh: Mesh) -> None:
    """Stage rl on several processes: each dp rank's rollouts split into the minibatches, sampled by the
    sharded policy itself (bf16; the FP8 copy is built from whole weights)."""
    if cfg.stage != "rl":
        return
    rows = cfg.batch_size // mesh.dp * cfg.group_size
    if cfg.batch_size % mesh.dp or rows % cfg.minibatches:
        raise ValueError(
            f"minibatches: expected a divisor of each dp rank's rollouts (batch_size / dp * "
            f"group_size = {cfg.batch_size} / {mesh.dp} * {cfg.group_size}), got "
            f"{cfg.minibatches}"
        )
    if cfg.rollout_precision != "bf16":
        raise ValueError("rollout_precision: fp8 on several processes is not in this build yet (use bf16)")


def existing_run(out: Path) -> str:
    """What of a training run `out` already holds that a new run would replace ('' if nothing): its
    checkpoints. A run killed before its first checkpoint holds only the metrics of steps it cannot
    continue from, and is started over."""
    n = len(checkpoints(out / "checkpoints"))
    if not n:
        return ""
    return ", ".join(
        [f"{n} checkpoint(s) in checkpoints/"]
        + [f for f in ("metrics.jsonl", "summary.json") if (out / f).exists()]
    )


def check_sequence_fits(model_path: Path | None, preset: str, tokens: int, hint: str) -> None:
    """Refuse sequences past the model's max_position_embeddings before anything is built (an unbounded
    --seq-len ran out of memory or failed deep inside the data loader)."""
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
    nproc: int,
    mesh: str | None,
    stage: str,
    batch_size: int,
    layout_invariant: bool = False,
    seq_len: int | None = None,
):
    """The Mesh of a run on several processes (None for one), checked against --nproc, --stage,
    --batch-size, --seq-len (sequence parallel) and --layout-invariant in one line naming the option
    (before any rank starts). Under torchrun, --nproc defaults to its WORLD_SIZE."""
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
    if parsed.sp > 1 and stage == "rl":
        raise click.BadParameter(
            f"sp={parsed.sp}: sequence parallel splits a step's tokens, which RL's rollouts do not fix",
            param_hint="'--mesh'",
        )
    if parsed.sp > 1 and seq_len is not None and batch_size // parsed.dp * seq_len % parsed.sp:
        raise click.BadParameter(
            f"sequence parallel splits each rank's {batch_size // parsed.dp} x {seq_len} tokens over "
            f"sp={parsed.sp}, which does not divide them",
            param_hint="'--seq-len'",
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
    ckpt = latest_checkpoint(out / "checkpoints") if resume else None
    if ckpt is not None and not dist_state.is_sharded(ckpt):
        raise click.BadParameter(
            f"{ckpt} was written by a 1-process run; resume it without --nproc (or --nproc 1)",
            param_hint="'--resume'",
        )


def check_resume_options(cfg, out: Path) -> None:
    """--resume continues under the run's saved options: an option given on this command line that differs
    from the saved one is refused by name (only --steps may change), never silently ignored."""
    import dataclasses

    from click.core import ParameterSource

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
