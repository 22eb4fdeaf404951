"""`glm5 train`: train a preset (tiny on CPU in minutes) on the standard library's source bytes, or (stage
rl) on its own rollouts with the IcePop objective."""

from __future__ import annotations

import json
import math
import os

import click

from glm5.cli_args import (
    MODEL_DEFAULT_BACKEND,
    backend_choice,
    check_preset,
    check_preset_fits,
    model_option,
    one_line_errors,
)
from glm5.infra import fsio
from glm5.threads import command_threads
from glm5.train import ownership
from glm5.train.checks import (
    check_options_used,
    check_plan_fits,
    check_resumable_sharded,
    check_resume_options,
    check_sequence_fits,
    parallel_options,
    pipeline_options,
    run_dir,
)
from glm5.train.muon.optimizer import MODES

_POS = click.IntRange(min=1)


class _FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (a range check lets nan through)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"expected a finite number, got {value!r}", param, ctx)
        return rv


_POS_FLOAT = _FiniteFloat(min=0, min_open=True)


@click.command()
@click.option(
    "--config",
    "preset",
    default="tiny",
    show_default=True,
    callback=check_preset,
    help="Preset from glm5/core/presets/.",
)
@click.option("--steps", default=200, show_default=True, type=_POS)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Run directory (a new one, or an existing run with --resume).",
)
@click.option("--deterministic", is_flag=True, help="Deterministic algorithms: reruns match bitwise.")
@click.option(
    "--resume", is_flag=True, help="Continue from OUT/checkpoints/latest (bit-exact if deterministic)."
)
@click.option("--backend", default=None, help="Backend name (default: $GLM5_BACKEND or cpu).")
@click.option("--optimizer", type=click.Choice(MODES), default="muon-split", show_default=True)
@click.option(
    "--stage",
    type=click.Choice(["warmup", "sparse", "rl"]),
    default="sparse",
    show_default=True,
    help="warmup: indexers only, dense KL; sparse: LM + MTP + sparse KL; rl: IcePop on rollouts.",
)
@model_option(
    help="Start from this checkpoint's weights (e.g. RUN/checkpoints/latest) instead of --config.",
    aliases=("--init",),
    quantized=False,
    sharded=True,
)
@click.option(
    "--batch-size",
    default=8,
    show_default=True,
    type=_POS,
    help="Windows per step (stage rl: prompts per step).",
)
@click.option("--seq-len", default=128, show_default=True, type=click.IntRange(min=2))
@click.option("--lr", default=3e-3, show_default=True, type=_POS_FLOAT)
@click.option(
    "--warmup-steps",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Linear LR warm-up steps.",
)
@click.option(
    "--mtp-steps",
    default=1,
    show_default=True,
    type=click.IntRange(min=0),
    help="MTP prediction steps (shared layer).",
)
@click.option("--eval-every", default=25, show_default=True, type=_POS)
@click.option("--save-every", default=100, show_default=True, type=_POS)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(min=0),
    help="torch intra-op threads (0: every core)  [default: $OMP_NUM_THREADS if set, else 1]",
)
@click.option(
    "--group-size",
    default=8,
    show_default=True,
    type=click.IntRange(min=2),
    help="Stage rl: responses per prompt (GRPO group).",
)
@click.option("--prompt-len", default=16, show_default=True, type=_POS, help="Stage rl: prompt bytes.")
@click.option(
    "--response-len", default=16, show_default=True, type=_POS, help="Stage rl: sampled tokens per response."
)
@click.option(
    "--ppo-epochs",
    default=2,
    show_default=True,
    type=_POS,
    help="Stage rl: passes over each step's rollouts.",
)
@click.option(
    "--minibatches",
    default=1,
    show_default=True,
    type=_POS,
    help="Stage rl: optimizer steps per pass (must divide batch-size * group-size).",
)
@click.option(
    "--temperature",
    default=1.0,
    show_default=True,
    type=_POS_FLOAT,
    help="Stage rl: sampling temperature (the log-probs are taken at it too).",
)
@click.option("--rollout-check/--no-rollout-check", default=True, show_default=True)
@click.option(
    "--rollout-precision",
    type=click.Choice(["bf16", "fp8"]),
    default="bf16",
    show_default=True,
    help="Sample in bf16 or with the FP8 policy (FP8 linears, indexer and cache): the rl stage's rollouts "
    "and the rollout check.",
)
@click.option(
    "--rollout-engine",
    type=click.Choice(["sync", "policy", "vllm"]),
    default="sync",
    show_default=True,
    help="Stage rl: sample in the step (sync), or asynchronously in an engine while the trainer trains: "
    "the project's decode path (policy) or vLLM with the plugin (vllm).",
)
@click.option(
    "--push-every",
    default=1,
    show_default=True,
    type=_POS,
    help="With a rollout engine: push the weights into it every N steps.",
)
@click.option(
    "--max-staleness",
    default=1,
    show_default=True,
    type=click.IntRange(min=0),
    help="With a rollout engine: train on no batch sampled more than S versions ago (S >= push-every - 1).",
)
@click.option(
    "--engine-tp",
    default=1,
    show_default=True,
    type=_POS,
    help="--rollout-engine vllm: tensor-parallel size.",
)
@click.option(
    "--layout-invariant",
    is_flag=True,
    help="With a rollout engine: the engine's sampling and the trainer's forwards in the layout-invariant "
    "mode (docs/spec.md 12), so their log-probs agree bitwise at any tensor-parallel size.",
)
@click.option(
    "--topk-record",
    is_flag=True,
    help="With a rollout engine: it returns its indexer top-k per generated token; metrics.jsonl gets the "
    "rollout/train top-k overlap per layer.",
)
@click.option(
    "--topk-replay",
    is_flag=True,
    help="With a rollout engine: the trainer's forwards use the engine's recorded indexer top-k instead of "
    "recomputing it (implies --topk-record).",
)
@click.option(
    "--nproc",
    default=1,
    show_default=True,
    type=_POS,
    help="Processes (ranks) on this machine; above 1 the command re-runs itself under torchrun.",
)
@click.option(
    "--mesh",
    default=None,
    help="Parallel layout, e.g. dp=2 or dp=2,tp=1,ep=1,pp=1 (axes multiply to --nproc); tp=N,sp=N: sequence "
    "parallel for the norms over the tp ranks  [default: dp=NPROC]",
)
@click.option(
    "--zero",
    type=click.Choice(["2", "3"]),
    default="3",
    show_default=True,
    help="FSDP2 stage: 3 frees each layer's parameters after forward, 2 keeps them for backward.",
)
@click.option(
    "--pp-schedule",
    type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b"]),
    default="1f1b",
    show_default=True,
    help="With --mesh pp=N: the pipeline schedule (interleaved: 2 stages each).",
)
@click.option(
    "--mtp-stage",
    type=click.Choice(["last", "own"]),
    default="last",
    show_default=True,
    help="With --mesh pp=N: the MTP layer with the last decoder layers, or a stage of its own.",
)
@click.option(
    "--microbatches",
    default=None,
    type=_POS,
    help="With --mesh pp=N: micro-batches per step (divides --batch-size)  [default: pp]",
)
@click.option(
    "--activations",
    type=click.Choice(["none", "recompute", "offload"]),
    default="none",
    show_default=True,
    help="Per decoder layer: keep activations, recompute them in the backward, "
    "or offload them to host memory.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(
    preset,
    steps,
    out,
    deterministic,
    resume,
    backend,
    optimizer,
    stage,
    model_path,
    batch_size,
    seq_len,
    lr,
    warmup_steps,
    mtp_steps,
    eval_every,
    save_every,
    seed,
    threads,
    group_size,
    prompt_len,
    response_len,
    ppo_epochs,
    minibatches,
    temperature,
    rollout_check,
    rollout_precision,
    rollout_engine,
    push_every,
    max_staleness,
    engine_tp,
    layout_invariant,
    topk_record,
    topk_replay,
    nproc,
    mesh,
    zero,
    pp_schedule,
    mtp_stage,
    microbatches,
    activations,
    quiet,
) -> None:
    """Train GLM-5 with Muon Split, MTP and the DSA stages, or RL with IcePop (--stage rl); metrics.jsonl,
    loss.png, checkpoints in OUT."""
    from glm5.train.distributed import runtime as distributed
    from glm5.train.loop import trainer as loop
    from glm5.train.loop.trainer import TrainConfig, Trainer, check_run
    from glm5.train.plots import plot_metrics
    from glm5.train.rl import asynchronous as rl_async

    if rollout_engine == "vllm":
        from glm5.train.rl.engines.vllm_engine import vllm_installed

        if not vllm_installed():
            raise click.BadParameter(
                "vllm: vLLM is not installed in this environment (install the 'vllm' extra, or use "
                "--rollout-engine policy)",
                param_hint="'--rollout-engine'",
            )
    parallel = parallel_options(nproc, mesh, stage, batch_size, layout_invariant, seq_len)
    check_options_used(stage, rollout_engine, parallel, resume)
    microbatches = pipeline_options(
        parallel,
        stage,
        batch_size,
        microbatches,
        pp_schedule,
        mtp_stage,
        None if resume else (model_path, preset),
    )
    backend = backend or os.environ.get("GLM5_BACKEND") or MODEL_DEFAULT_BACKEND
    backend_choice(backend)
    check_preset_fits(None if model_path is not None or resume else preset, "'--config'")
    check_plan_fits(parallel, None if model_path is not None or resume else preset)
    with one_line_errors():
        cfg = TrainConfig(  # a ValueError names the option (e.g. minibatches not dividing the rollouts)
            preset=preset,
            backend=backend,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            warmup_steps=warmup_steps,
            optimizer=optimizer,
            stage=stage,
            mtp_steps=mtp_steps,
            eval_every=eval_every,
            save_every=save_every,
            seed=seed,
            deterministic=deterministic,
            threads=command_threads("train", threads),
            init=None if model_path is None else str(model_path),
            group_size=group_size,
            prompt_len=prompt_len,
            response_len=response_len,
            ppo_epochs=ppo_epochs,
            minibatches=minibatches,
            temperature=temperature,
            rollout_precision=rollout_precision,
            rollout_engine=rollout_engine,
            push_every=push_every,
            max_staleness=max_staleness,
            engine_tp=engine_tp,
            layout_invariant=layout_invariant,
            topk_record=topk_record,
            topk_replay=topk_replay,
            pp_schedule=pp_schedule,
            mtp_stage=mtp_stage,
            microbatches=microbatches,
            activations=activations,
        )
    if not resume:  # a resumed run keeps its saved options (checked against them below)
        check_sequence_fits(
            model_path,
            preset,
            seq_len if stage != "rl" else prompt_len + response_len,
            "'--seq-len'" if stage != "rl" else "'--prompt-len' + '--response-len'",
        )
    out = run_dir(out, resume)
    ranked = distributed.under_torchrun()
    lock = ownership.owner(out)  # this process's locks of the run (a rank: and its death with the launcher)
    with lock, ownership.on_interrupt(out, rank=ranked):
        # a checkpoint a killed save set aside is put back before the resume check reads it (the Trainer
        # does it too, for library callers)
        fsio.recover(out / "checkpoints")
        if resume:
            with one_line_errors():  # a broken trainer_state.json: one line naming it
                check_resume_options(cfg, out)
        launcher = parallel is not None and not ranked
        try:
            if launcher:  # what a rank would refuse without a process group: refused here, once, at once
                check_run(cfg, out, resume, parallel)
                check_resumable_sharded(out, resume)
            else:
                trainer = Trainer(cfg, out, resume=resume, mesh=parallel, zero=int(zero))
        except loop.RunExists as exc:
            raise click.BadParameter(str(exc), param_hint="'--out'") from None
        except loop.NothingToResume as exc:
            raise click.BadParameter(str(exc), param_hint="'--resume'") from None
        except loop.StepsDone as exc:
            raise click.BadParameter(str(exc), param_hint="'--steps'") from None
        except ValueError as exc:  # e.g. a held-out split too small for the asked windows
            raise click.UsageError((str(exc).splitlines() or [type(exc).__name__])[0]) from None
        if launcher:
            ownership.launch(out, nproc)  # SystemExit with the ranks' code, one line for a dead rank
            return
        try:
            with one_line_errors():
                summary = trainer.run(progress=not quiet)
        except (loop.Diverged, rl_async.EngineFailed) as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:  # a full disk: the save's staging is gone, the last checkpoint intact
            raise click.ClickException(f"{fsio.describe(exc)} (nothing of this save was published)") from None
        finally:
            rl_async.close(trainer.rl)  # the rollout engine and its producer, if the run had them
        if trainer.dist is not None:
            trainer.dist.close()
            if not trainer.dist.is_writer:
                return
            rollout_check = False  # the sampler runs on a whole model: check the exported checkpoint instead
        try:
            plot_metrics(out / "metrics.jsonl", out / "loss.png", summary["init_eval_loss"])
        except ImportError as exc:
            click.echo(
                f"loss.png not written: {exc} (the plot needs the 'train' extra: pip install "
                "'glm5-backends[train]'; metrics.jsonl holds every number)",
                err=True,
            )
        if rollout_check:
            from glm5.train.rl.rollout import rollout_check as check

            prompts = trainer.heldout[0][:2, :32].to(trainer.device)
            stats = check(
                trainer.model,
                prompts,
                16,
                seed=seed,
                invariant=trainer.cfg.deterministic,
                rollout_precision=trainer.cfg.rollout_precision,
            )
            stats.pop("sampled")
            summary["rollout"] = stats
            fsio.write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    click.echo(json.dumps(summary, indent=2))
    latest = out / "checkpoints" / "latest"
    use = (
        f"glm5 checkpoint export-hf {latest} HF_DIR, then glm5 generate --model HF_DIR"
        if parallel
        else f"e.g. glm5 generate --model {latest}"
    )
    click.echo(f"checkpoint: {latest}  ({use})", err=True)
