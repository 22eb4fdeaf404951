"""The training loop: LM + MTP losses, the DSA stage's indexer KL, Muon (Split) + AdamW, aux-loss-free
expert balancing, held-out evaluation, metrics, atomic checkpoints and bit-exact resume.

Stages (DeepSeek-V3.2 section 2.1, GLM-5): 'warmup' freezes everything but the indexers and trains them
on the dense KL alone; 'sparse' trains the whole model on LM + MTP while the indexers learn the KL
restricted to their selected keys (the indexer input is detached in the model, so the two never mix).
'rl' trains the policy on its own rollouts with the IcePop objective (glm5/train/rl/stage.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.infra import fsio
from glm5.train.checks import (  # noqa: F401 - RunExists, NothingToResume, StepsDone: caught by callers here
    NothingToResume,
    RunExists,
    StepsDone,
    check_rl_on_mesh,
    check_run,
)
from glm5.train.distributed import checkpoint as dist_state
from glm5.train.distributed.mesh import Mesh
from glm5.train.distributed.pipeline.run import PipelineDist, pipeline_evaluate, pipeline_step
from glm5.train.loop.activations import checkpoint_layers
from glm5.train.loop.data import VOCAB_MIN, ByteCorpus
from glm5.train.loop.dsa import AttentionProbe, ExpertBalancer
from glm5.train.loop.losses import lm_and_mtp
from glm5.train.loop.options import TrainConfig, set_determinism
from glm5.train.loop.state import load_into, save_checkpoint
from glm5.train.muon.optimizer import build_optimizers
from glm5.train.rl.asynchronous import async_rl_step
from glm5.train.rl.stage import RLContext, rl_step


class Diverged(RuntimeError):
    """The loss, the gradient norm or the parameters became NaN or infinite: the run stops before it
    would publish a checkpoint of them."""


class Trainer:
    """Run `cfg.steps` optimizer steps into `out` (metrics.jsonl, checkpoints/, loss.png, summary.json).
    With `resume`, continue from `out/checkpoints/latest` under the saved options (only `steps` may change).
    With `mesh` (under torchrun, one Trainer per rank): FSDP2 data parallel at ZeRO stage `zero`
    (glm5/train/distributed/runtime.py), sharded checkpoints (glm5/train/distributed/checkpoint.py), which
    also resume on another number of ranks.
    """

    def __init__(
        self, cfg: TrainConfig, out: str | Path, resume: bool = False, mesh: Mesh | None = None, zero: int = 3
    ) -> None:
        self.out = Path(out)
        self.ckpt_root = self.out / "checkpoints"
        self.start_step, self.init_eval = 0, None
        from glm5.train.distributed.runtime import lock_held_by_launcher

        # a rank of `glm5 train --nproc N`: its launcher read the checksums, the rank checks the rest
        checksums = mesh is None or not lock_held_by_launcher()
        ckpt, cfg, saved = check_run(cfg, self.out, resume, checksums=checksums)
        if saved is not None:
            self.start_step, self.init_eval = saved["step"], saved.get("init_eval_loss")
        self.cfg = cfg
        set_determinism(cfg)
        sharded = next((Path(p) for p in (ckpt, cfg.init) if p and dist_state.is_sharded(p)), None)
        if sharded is not None:  # weights loaded once the model is sharded
            self.model = dist_state.empty_model(sharded, cfg.backend)
        elif ckpt is not None:
            self.model = GLM5ForCausalLM.from_pretrained(ckpt, backend=cfg.backend)
        elif cfg.init:
            self.model = GLM5ForCausalLM.from_pretrained(cfg.init, backend=cfg.backend)
        else:
            self.model = GLM5ForCausalLM(GLM5Config.from_preset(cfg.preset), backend=cfg.backend)
            self.model.init_weights(cfg.seed)
        if self.model.config.vocab_size < VOCAB_MIN:
            raise ValueError(f"config: byte-level data needs vocab_size >= {VOCAB_MIN}")
        if cfg.stage == "warmup":  # base frozen: only the indexers learn
            for name, p in self.model.named_parameters():
                p.requires_grad_(".indexer." in name)
        checkpoint_layers(self.model, cfg.activations)  # before any sharding wraps the layers
        self.dist = None
        if mesh is not None:
            from glm5.train.distributed.runtime import Dist

            check_rl_on_mesh(cfg, mesh)
            plain = ckpt if sharded is None else None
            if mesh.pp > 1:
                self.dist = PipelineDist.for_pipeline(mesh, cfg, self.model, plain)
            else:
                self.dist = Dist.for_run(mesh, zero, self.model, cfg.batch_size, plain)
        plan_mesh = None if self.dist is None else self.dist.plan_mesh
        if sharded is not None:
            dist_state.load_model(sharded, self.model, plan_mesh)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dist is not None:
            self.optimizers = self.dist.optimizers(self.model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        else:
            self.optimizers = build_optimizers(self.model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        if ckpt is not None and sharded is not None:
            dist_state.load_trainer(ckpt, self.model, self.optimizers, plan_mesh)
        elif ckpt is not None:
            load_into(ckpt, self.optimizers)
        self.corpus = ByteCorpus(max_bytes=cfg.max_bytes)
        self.heldout = self.corpus.heldout_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches)
        self.probe = AttentionProbe(self.model, stage=None if cfg.stage == "rl" else cfg.stage)
        gamma = 0.0 if cfg.stage == "warmup" else cfg.balance_gamma
        self.balancer = (self.dist.balancer if self.dist else ExpertBalancer)(self.model, gamma)
        self.device = self.model.backend.device
        # the RL stage's pieces (glm5/train/rl/stage.py): it does not reach into the trainer
        self.rl = RLContext(
            self.cfg,
            self.model,
            self.optimizers,
            self.clip_gradients,
            self.corpus,
            self.device,
            self.dist,
            self.probe,
            self.balancer,
        )

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        if cfg.stage == "rl":
            rec = (rl_step if cfg.rollout_engine == "sync" else async_rl_step)(self.rl, step)
            return rec if self.dist is None else self.dist.global_rl_record(rec)
        if self.dist is not None and self.dist.mesh.pp > 1:
            return pipeline_step(self, step)
        t0 = time.perf_counter()
        ids = self.corpus.batch(cfg.batch_size, cfg.seq_len, cfg.seed, step).to(self.device)
        if self.dist is not None:
            ids = self.dist.local_batch(ids)
        self.model.train()
        self.probe.reset()
        self.probe.active = self.balancer.active = True
        lr = cfg.lr_at(step)
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = lr
        losses = lm_and_mtp(self.model, ids, cfg.mtp_steps)
        kl = self.probe.kl_loss()
        if cfg.stage == "warmup":
            total = cfg.kl_weight * kl
        else:
            total = losses.lm
            if losses.mtp is not None:
                total = total + cfg.mtp_weight * losses.mtp
            if kl is not None:
                total = total + cfg.kl_weight * kl
        total.backward()
        gnorm = self.clip_gradients()
        for o in self.optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        violation = self.balancer.update()
        rec = {
            "step": step + 1,
            "loss": float(total.detach()),
            "lm_loss": float(losses.lm.detach()),
            "mtp_loss": None if losses.mtp is None else float(losses.mtp.detach()),
            "kl_loss": None if kl is None else float(kl.detach()),
            "lr": lr,
            "grad_norm": float(gnorm),
            "max_attn_logit": max(self.probe.max_logits) if self.probe.max_logits else None,
            "moe_max_violation": violation,
            "tokens": (step + 1) * cfg.batch_size * cfg.seq_len,
            "step_s": time.perf_counter() - t0,
        }
        return rec if self.dist is None else self.dist.global_record(rec)

    def clip_gradients(self) -> torch.Tensor:
        """Clip the gradients to `grad_clip` of their global norm (over every rank's shards); the norm."""
        if self.dist is not None:
            return self.dist.clip_grad_norm(self.params, self.cfg.grad_clip)
        return torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=False)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss (nats per byte) over the fixed held-out batches."""
        if self.dist is not None and self.dist.mesh.pp > 1:
            return pipeline_evaluate(self)
        self.model.eval()
        self.probe.active = self.balancer.active = False
        losses = [
            float(self.model(b.to(self.device), labels=b.to(self.device), return_logits=False).loss)
            for b in self.heldout
        ]
        if self.dist is not None:
            self.dist.reshard(self.model)
        return sum(losses) / len(losses)

    # -- the run ----------------------------------------------------------------------------------
    def run(self, progress: bool = True) -> dict:
        cfg = self.cfg
        writer = self.dist is None or self.dist.is_writer  # rank 0 alone writes metrics and the summary
        self.out.mkdir(parents=True, exist_ok=True)
        metrics_path = self.out / "metrics.jsonl"
        if writer:
            _truncate_metrics(metrics_path, self.start_step)
        if self.dist is not None:
            self.dist.barrier()
        if self.init_eval is None:
            self.init_eval = self.evaluate()
        t0 = time.perf_counter()
        max_logit = 0.0
        sink = metrics_path.open("a") if writer else open(os.devnull, "w")  # noqa: SIM115
        with _progress(progress and writer, cfg.steps, self.start_step) as bar, sink as mf:
            for step in range(self.start_step, cfg.steps):
                rec = self.train_step(step)
                done = step + 1
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    rec["eval_loss"] = self.evaluate()
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                _check_finite(rec, done)
                if rec["max_attn_logit"] is not None:
                    max_logit = max(max_logit, rec["max_attn_logit"])
                if done % cfg.save_every == 0 or done == cfg.steps:
                    self._check_parameters(done)
                    if writer:
                        os.fsync(mf.fileno())  # the records a checkpoint covers are on disk before it is
                    if self.dist is not None:
                        dist_state.save_sharded(
                            self.ckpt_root,
                            done,
                            self.model,
                            self.optimizers,
                            self._trainer_state(),
                            cfg.keep,
                            self.dist.plan_mesh,
                        )
                    else:
                        save_checkpoint(
                            self.ckpt_root, done, self.model, self.optimizers, self._trainer_state(), cfg.keep
                        )
                bar(done, rec)
        summary = {
            "steps": cfg.steps,
            "optimizer": cfg.optimizer,
            "stage": cfg.stage,
            "init_eval_loss": self.init_eval,
            "final_eval_loss": _last(metrics_path, "eval_loss"),
            "max_attn_logit_this_run": max_logit,
            **(_reward_span(metrics_path) if cfg.stage == "rl" else {}),
            "train_seconds_this_run": time.perf_counter() - t0,
        }
        if self.dist is not None:
            summary["world"] = self.dist.world
            summary["mesh"] = str(self.dist.mesh)
            if not self.dist.model_parallel:
                summary["zero"] = self.dist.zero
        if writer:
            fsio.write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _trainer_state(self) -> dict:
        return {"config": dataclasses.asdict(self.cfg), "init_eval_loss": self.init_eval}

    @torch.no_grad()
    def _check_parameters(self, done: int) -> None:
        from glm5.train.distributed.runtime import local

        bad = [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(local(p)).all())]
        if self.dist is not None and self.dist.max(float(len(bad))) and not bad:
            bad = ["(a shard on another rank)"]
        if bad:
            raise Diverged(
                f"training diverged at step {done}: {len(bad)} parameter tensor(s) hold NaN or "
                f"infinite values (e.g. {bad[0]}); no checkpoint written for it (try a lower "
                "--lr)"
            )


def _check_finite(rec: dict, done: int) -> None:
    """Diverged if the step's loss or gradient norm is NaN or infinite."""
    for key in ("loss", "grad_norm", "eval_loss"):
        value = rec.get(key)
        if value is not None and not math.isfinite(value):
            raise Diverged(
                f"training diverged at step {done}: {key} is {value}; no checkpoint written for "
                "it (try a lower --lr)"
            )


def _records(path: Path) -> list[dict]:
    """The metrics records; a torn last line (a kill mid-write) is dropped, any other bad line is an error."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = []
    for i, ln in enumerate(lines):
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(
                    f"{path}: line {i + 1} is not JSON (only a torn last line is dropped)"
                ) from None
    return out


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= step (a resumed run rewrites what followed its checkpoint)."""
    if not path.exists():
        return
    keep = [rec for rec in _records(path) if rec["step"] <= step]
    fsio.write_text_atomic(path, "".join(json.dumps(rec) + "\n" for rec in keep))


def _reward_span(path: Path) -> dict:
    rewards = [rec["reward_mean"] for rec in _records(path)]
    return {"reward_first_step": rewards[0], "reward_last_step": rewards[-1]}


def _last(path: Path, key: str) -> float | None:
    val = None
    for rec in _records(path):
        if rec.get(key) is not None:
            val = rec[key]
    return val


class _progress:
    """A rich progress bar (or nothing): `bar(done, rec)` advances it and shows the latest losses."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.enabled, self.total, self.start = enabled, total, start

    def __enter__(self):
        if not self.enabled:
            return lambda done, rec: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.p.__enter__()
        task = self.p.add_task("train", total=self.total, completed=self.start, info="")
        last_eval: list[float] = []

        def bar(done: int, rec: dict) -> None:
            if "eval_loss" in rec:
                last_eval[:] = [rec["eval_loss"]]
            rl = "reward_mean" in rec
            info = f"reward {rec['reward_mean']:.3f}" if rl else f"loss {rec['lm_loss']:.3f}"
            info += f"  held-out {last_eval[0]:.3f}" if last_eval else ""
            self.p.update(task, completed=done, info=info)

        return bar

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.p.__exit__(*exc)
