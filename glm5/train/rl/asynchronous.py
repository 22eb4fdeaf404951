"""Asynchronous RL (`glm5 train --stage rl --rollout-engine policy|vllm`): a rollout engine in its own
thread (and, for vLLM, its own processes) samples the batches of steps n+1, n+2, ... while the trainer
trains on step n.

- Token in, token out: the engine (glm5/train/rl/engines/local.py's interface) gets the prompts' token ids
  and returns the sampled ids, their log-probs under the engine's weights (pi_rollout) and the policy
  version of those weights; the trainer never re-tokenises.
- Versions: the policy version is the number of training steps done. Every `push_every` steps the trainer
  hands its whole weights (gathered from every rank's shards) to the producer, which pushes them into the
  engine in place before its next batch. A batch of step n sampled by version v lags n - v versions
  (its staleness, recorded per sample). The producer samples batch n only once the engine holds a version
  >= n - max_staleness, so the trainer waits (on the queue) rather than train on older samples; that
  bound is reachable only when max_staleness >= push_every - 1 (checked with the options).
- The update is the synchronous stage's (glm5/train/rl/stage.py `scored`, `update`): logp_old from the
training
  forward under the current weights, IcePop's double-sided pop() on pi_train_old / pi_rollout with the
  engine's log-probs, the indexer frozen (the rl stage trains no indexer loss).
- On several processes rank 0 owns the engine and the producer; each step's responses, log-probs and
  versions are broadcast, and every rank trains on its data-parallel share.

Figures per step (metrics.jsonl): staleness_max / staleness_mean, engine_version, wait_s (the trainer
blocked on the queue), rollout_tokens_per_s (tokens sampled per second the engine was busy),
train_tokens_per_s (response tokens trained per second the trainer was busy) and overlap (the wall time
both were busy over the wall time since the loop started), all since the loop started; the IcePop
ratio figures (mismatch_min / mismatch_max / mismatch_outside) are the synchronous stage's. With
--topk-record / --topk-replay the engine returns its indexer top-k per generated token, the trainer's
forwards compare (and, replay, use) it and the step records topk_overlap / topk_overlap_layers
(glm5/train/rl/topk_replay.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from glm5.train.rl.engines.local import Generation, NamedTensors, PolicyEngine, RolloutEngine, policy_tensors
from glm5.train.rl.rollout import batch_invariant
from glm5.train.rl.stage import ROLLOUT_ENGINES, scored, update
from glm5.train.rl.topk_replay import RolloutTopk

if TYPE_CHECKING:
    from glm5.train.rl.stage import RLContext

ENGINES = ROLLOUT_ENGINES
_SEED = 0xA5C << 20  # the engine's per-step sampling seeds, apart from the synchronous stage's


class EngineFailed(RuntimeError):
    """The rollout engine (or its producer thread) stopped with an error."""


class Intervals:
    """Busy intervals of one side (appended in time order by one thread), their total and their overlap
    with another side's."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        self.spans.append((start, end))

    def total(self) -> float:
        return sum(b - a for a, b in list(self.spans))

    def overlap(self, other: Intervals) -> float:
        """Seconds both were busy."""
        xs, ys = list(self.spans), list(other.spans)
        i = j = 0
        both = 0.0
        while i < len(xs) and j < len(ys):
            lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
            both += max(0.0, hi - lo)
            if xs[i][1] < ys[j][1]:
                i += 1
            else:
                j += 1
        return both


@dataclass
class Batch:
    step: int
    gen: Generation


class Producer(threading.Thread):
    """Samples the batches of steps [start, end) into a bounded queue, pushing offered weights into the
    engine first, and never a batch more than `max_staleness` versions behind its step."""

    def __init__(self, engine: RolloutEngine, prompts, cfg, start: int, end: int) -> None:
        super().__init__(name="glm5-rollouts", daemon=True)
        self.engine, self.prompts, self.cfg = engine, prompts, cfg
        self.start_step, self.end = start, end
        self.queue: queue.Queue[Batch] = queue.Queue(maxsize=cfg.max_staleness + 1)
        self.cond = threading.Condition()
        self.pending: tuple[NamedTensors, int] | None = None
        self.stopped = False
        self.error: BaseException | None = None
        self.busy = Intervals()
        self.tokens = 0

    def offer(self, named: NamedTensors, version: int) -> None:
        """New weights for the engine (a newer offer replaces one not pushed yet)."""
        with self.cond:
            self.pending = (named, version)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _fresh_engine(self, step: int) -> bool:
        """Push what is pending; wait until the engine's version may sample `step` (False: stopped)."""
        while True:
            with self.cond:
                while (
                    not self.stopped
                    and self.pending is None
                    and self.engine.version < step - self.cfg.max_staleness
                ):
                    self.cond.wait()
                if self.stopped:
                    return False
                pending, self.pending = self.pending, None
            if pending is not None:
                self.engine.push(*pending)
            if self.engine.version >= step - self.cfg.max_staleness:
                return True

    def run(self) -> None:
        cfg = self.cfg
        try:
            for step in range(self.start_step, self.end):
                if not self._fresh_engine(step):
                    return
                t0 = time.perf_counter()
                gen = self.engine.generate(
                    self.prompts(step),
                    cfg.response_len,
                    temperature=cfg.temperature,
                    seed=_SEED + cfg.seed * 1_000_003 + step,
                )
                self.busy.add(t0, time.perf_counter())
                self.tokens += gen.responses.numel()
                while not self.stopped:
                    try:
                        self.queue.put(Batch(step, gen), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the trainer, which raises it
            self.error = exc
        finally:  # every batch sampled (or stopped): the engine has nothing left to do
            self.engine.close()


def records_topk(cfg) -> bool:
    return cfg.topk_record or cfg.topk_replay


def make_engine(cfg, model, named: NamedTensors, version: int) -> RolloutEngine:
    if cfg.rollout_engine == "policy":
        return PolicyEngine(
            model.config,
            model.backend.name,
            named,
            version,
            invariant=cfg.layout_invariant,
            record_topk=records_topk(cfg),
        )
    from glm5.train.rl.engines.vllm_engine import VllmEngine

    return VllmEngine(
        model,
        named,
        version,
        tensor_parallel_size=cfg.engine_tp,
        max_model_len=cfg.prompt_len + cfg.response_len,
        max_num_seqs=cfg.batch_size * cfg.group_size,
        layout_invariant=cfg.layout_invariant,
        record_topk=records_topk(cfg),
        temperature=cfg.temperature,
    )


class AsyncRollouts:
    """The trainer's side of the loop: the engine and producer (rank 0), the batches and the pushes."""

    def __init__(self, ctx: RLContext, start: int) -> None:
        self.ctx, cfg, d = ctx, ctx.cfg, ctx.dist
        self.rank0 = d is None or d.rank == 0
        self.train_busy = Intervals()
        self.trained_tokens = 0
        self.t_start = time.perf_counter()
        named = policy_tensors(ctx)  # every rank takes part in the gather
        self.producer: Producer | None = None
        if self.rank0:
            try:
                engine = make_engine(cfg, ctx.model, named, start)
            except Exception as exc:  # e.g. vLLM refusing its configuration
                first = (str(exc).splitlines() or [""])[0]
                raise EngineFailed(f"rollout engine: could not start {cfg.rollout_engine}: {first}") from exc
            self.producer = Producer(engine, self.prompts, cfg, start, cfg.steps)
            self.producer.start()

    def prompts(self, step: int) -> torch.Tensor:
        """The global batch's prompts of `step`, each repeated group_size times (a function of the seed
        and the step)."""
        cfg = self.ctx.cfg
        return self.ctx.corpus.batch(cfg.batch_size, cfg.prompt_len, cfg.seed, step).repeat_interleave(
            cfg.group_size, 0
        )

    def next(self, step: int) -> tuple[torch.Tensor, Generation, float]:
        """The prompts and generation of `step` (this rank's rows) and the seconds waited for them."""
        t0 = time.perf_counter()
        gen = self._take(step) if self.rank0 else None
        waited = time.perf_counter() - t0
        prompts = self.prompts(step)
        d = self.ctx.dist
        if d is not None:
            gen = self._broadcast(gen, prompts.shape[0])
            topk = None if gen.topk is None else d.local_batch(gen.topk)
            prompts, gen = (
                d.local_batch(prompts),
                Generation(d.local_batch(gen.responses), d.local_batch(gen.logprobs), gen.version, topk),
            )
        return prompts, gen, waited

    def _take(self, step: int) -> Generation:
        p = self.producer
        while True:
            if p.error is not None:
                raise EngineFailed(f"rollout engine: {type(p.error).__name__}: {p.error}") from p.error
            try:
                batch = p.queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not p.is_alive() and p.queue.empty():
                    raise EngineFailed(
                        f"rollout engine: the producer stopped before step {step + 1}"
                    ) from None
        if batch.step != step:
            raise RuntimeError(f"rollout engine: expected the batch of step {step}, got step {batch.step}")
        return batch.gen

    def _broadcast(self, gen: Generation | None, rows: int) -> Generation:
        import torch.distributed as dist

        cfg, mc = self.ctx.cfg, self.ctx.model.config
        if gen is None:
            topk = None
            if records_topk(cfg):
                layers = mc.indexer_types.count("full")
                topk = torch.empty(rows, cfg.response_len, layers, mc.index_topk, dtype=torch.int32)
            gen = Generation(
                torch.empty(rows, cfg.response_len, dtype=torch.int64),
                torch.empty(rows, cfg.response_len, dtype=torch.float32),
                -1,
                topk,
            )
        version = torch.tensor([gen.version], dtype=torch.int64)
        for t in (gen.responses, gen.logprobs, version, gen.topk):
            if t is not None:
                dist.broadcast(t, 0)
        return Generation(gen.responses, gen.logprobs, int(version), gen.topk)

    def after_step(self, done: int) -> None:
        """Push the weights every push_every steps (a collective on several processes)."""
        cfg = self.ctx.cfg
        if done % cfg.push_every or done >= cfg.steps:
            return
        named = policy_tensors(self.ctx)
        if self.producer is not None:
            self.producer.offer(named, done)

    def figures(self) -> dict:
        now = time.perf_counter()
        wall = max(now - self.t_start, 1e-9)
        p = self.producer
        roll_busy = p.busy.total() if p else 0.0
        train_busy = self.train_busy.total()
        return {
            "rollout_tokens_per_s": (p.tokens / roll_busy) if p and roll_busy else None,
            "train_tokens_per_s": self.trained_tokens / train_busy if train_busy else None,
            "overlap": (p.busy.overlap(self.train_busy) / wall) if p else None,
            "engine_pushes": p.engine.pushes if p else None,
        }

    def close(self) -> None:
        p, self.producer = self.producer, None
        if p is not None:
            p.stop()
            p.join(timeout=60)


def async_rl_step(ctx: RLContext, step: int) -> dict:
    """One step of the asynchronous loop (module docstring) -> its metrics record."""
    cfg = ctx.cfg
    ar = ctx.session.get("async_rollouts")
    if ar is None:
        ar = ctx.session["async_rollouts"] = AsyncRollouts(ctx, step)
    prompts, gen, waited = ar.next(step)
    t0 = time.perf_counter()
    staleness = step - gen.version
    if staleness > cfg.max_staleness or staleness < 0:
        raise RuntimeError(f"rollout engine: a batch {staleness} versions old at step {step + 1}")
    lr = cfg.lr_at(step)
    for o in ctx.optimizers:
        for g in o.param_groups:
            g["lr"] = lr
    dev = ctx.device
    tk = None if gen.topk is None else RolloutTopk(prompts, gen.responses, gen.topk, cfg.topk_replay)
    forward = partial(_forward, ctx.model, cfg.layout_invariant, tk)
    if tk is not None:
        tk.measuring = True  # the figure: the forward of logp_old, under the step's weights
    with forward():
        ro = scored(ctx, prompts.to(dev), gen.responses.to(dev), gen.logprobs.to(dev))
    if tk is not None:
        tk.measuring = False
    rec = update(ctx, ro, step, lr, t0, forward)
    ar.after_step(step + 1)
    ar.train_busy.add(t0, time.perf_counter())
    ar.trained_tokens += ro.responses.numel()
    versions = torch.full((ro.responses.shape[0],), gen.version)  # per sample
    lag = step - versions
    rec.update(
        engine_version=gen.version,
        staleness_max=int(lag.max()),
        staleness_mean=float(lag.float().mean()),
        wait_s=waited,
        **ar.figures(),
    )
    if tk is not None:
        rec.update(tk.figures(dist=ctx.dist is not None))
    return rec


@contextlib.contextmanager
def _forward(model, invariant: bool, tk: RolloutTopk | None):
    """The trainer's forwards of a step: in the layout-invariant mode and / or with the rollout's top-k."""
    with contextlib.ExitStack() as stack:
        if invariant:
            stack.enter_context(batch_invariant(model))
        if tk is not None:
            stack.enter_context(tk.hooks(model))
        yield


def close(owner: Any) -> None:
    """End the engine and the producer of the asynchronous loop (if there is one) of `owner`: an
    RLContext, or a trainer (its `rl`)."""
    session = getattr(owner, "rl", owner).session
    ar = session.pop("async_rollouts", None)
    if ar is not None:
        ar.close()
