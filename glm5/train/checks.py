"""What `glm5 train` checks before it builds anything, callable without a process group, so the launcher of
`--nproc N` runs it before any rank starts and each rank (its Trainer) again: the run directory against
--resume, the steps, the trainer state and a sharded checkpoint's manifest, and the options a run on
several processes refuses."""

from __future__ import annotations

from pathlib import Path

from glm5.core.checkpoint import BadCheckpointFile, read_config
from glm5.infra import fsio
from glm5.train.distributed import checkpoint as dist_state
from glm5.train.distributed.manifest import verify
from glm5.train.distributed.mesh import Mesh
from glm5.train.loop.options import TrainConfig
from glm5.train.loop.state import checkpoints, latest_checkpoint, load_trainer_state


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
