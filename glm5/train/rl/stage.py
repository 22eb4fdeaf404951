"""The RL stage (`TrainConfig.stage == "rl"`): GRPO-style group rollouts trained with IcePop
(glm5/train/rl/icepop.py), rollouts sampled by the decode path of the policy being trained (bf16) or of an
FP8 copy of its current weights (FP8 linears, indexer and cache: what an FP8 engine serves).

One step (`rl_step`):
1. prompts: `batch_size` windows of `prompt_len` bytes of the training corpus, a function of (seed, step)
   like every other batch; each is repeated `group_size` times.
2. rollout: `response_len` tokens per response at `temperature` from `rollout_policy` (rebuilt from the
   current weights each step, so the engine follows the policy), with the sampled tokens' log-probs
   pi_rollout. The sampling generator is seeded from (seed, step), so a resumed run samples the same.
3. logp_old: the training forward (no grad) over the same minibatches the updates use, so the first
   update's PPO ratio is exactly 1.
4. reward (`prompt_bytes_reward`) and GRPO advantages per prompt group (`group_advantages`).
5. `ppo_epochs` passes over `minibatches` contiguous minibatches, one optimizer step each: IcePop loss
   (pop with beta 2, clip 0.2 / 0.28), gradient clipping, the run's LR for this step.

The reward is verifiable and needs nothing but the prompt: the share of response tokens that are bytes
occurring in the prompt. A random-init byte policy scores about 0.02 (its mass spreads over the 512-token
vocabulary); it learns within tens of steps to emit bytes of the prompt (and bytes common in Python
source), so a short run shows whether the objective's sign, the clip and pop work together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from glm5.train.rl.icepop import IcePopStats, group_advantages, icepop_loss, pop
from glm5.train.rl.rollout import rollout_policy, sample, sequence_logprobs

if TYPE_CHECKING:
    from glm5.train.loop.trainer import TrainConfig

#: who samples: this process's policy in the step ("sync"), or an engine of the asynchronous loop
#: (glm5/train/rl/asynchronous.py): the project's decode path ("policy") or vLLM with the plugin ("vllm")
ROLLOUT_ENGINES = ("sync", "policy", "vllm")
_SAMPLE_SEED = 0x5EED << 32  # keeps the sampling generator's seeds apart from the data batches'


@dataclass(frozen=True)
class RLContext:
    """What the RL stage is given by the trainer (built once in `Trainer.__init__`), instead of reaching
    into it: the run's config (its lr schedule `cfg.lr_at`), the policy, its optimizers and gradient
    clipping, the prompt source, the device, the data-parallel group (None on one process) and the
    attention probe / expert balancer it switches off while sampling. `session` holds the asynchronous
    loop's engine and producer between steps (glm5/train/rl/asynchronous.py)."""

    cfg: TrainConfig
    model: Any
    optimizers: list
    clip_gradients: Callable[[], torch.Tensor]
    corpus: Any
    device: Any
    dist: Any
    probe: Any
    balancer: Any
    session: dict = field(default_factory=dict)


def prompt_bytes_reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """prompts [B, P], responses [B, N] -> reward [B] fp32: the share of each response's tokens that occur
    in its prompt."""
    hits = (responses[:, :, None] == prompts[:, None, :]).any(-1)  # [B, N]
    return hits.float().mean(1)


@dataclass
class Rollouts:
    prompts: torch.Tensor  # [R, P], R = batch_size * group_size, a group's responses adjacent
    responses: torch.Tensor  # [R, N]
    logp_rollout: torch.Tensor  # [R, N] fp32, the rollout engine's
    logp_old: torch.Tensor  # [R, N] fp32, the training forward's at sampling time
    rewards: torch.Tensor  # [R]
    advantages: torch.Tensor  # [R]


def minibatch_rows(n_rows: int, minibatches: int) -> list[slice]:
    """The fixed contiguous minibatches of every epoch (logp_old is computed over the same ones)."""
    n = n_rows // minibatches
    return [slice(i * n, (i + 1) * n) for i in range(minibatches)]


def sample_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The sampling generator of step `step`; `stream` > 0 for the other data-parallel ranks' prompts."""
    return torch.Generator().manual_seed(_SAMPLE_SEED + seed * 1_000_003 + step + stream * (1 << 40))


@torch.no_grad()
def collect(ctx: RLContext, step: int) -> Rollouts:
    """Prompts, rollouts, logp_old, rewards and advantages of RL step `step`."""
    cfg, model = ctx.cfg, ctx.model
    prompts = ctx.corpus.batch(cfg.batch_size, cfg.prompt_len, cfg.seed, step).to(ctx.device)
    d = ctx.dist
    if d is not None:  # each data-parallel rank samples its own prompts' groups
        prompts = d.local_batch(prompts)
    prompts = prompts.repeat_interleave(cfg.group_size, 0)
    ctx.probe.active = ctx.balancer.active = False
    model.eval()
    policy = rollout_policy(model, cfg.rollout_precision)
    g = sample_generator(cfg.seed, step, 0 if d is None else d.dp_rank)
    responses, logp_roll = sample(policy, prompts, cfg.response_len, temperature=cfg.temperature, generator=g)
    return scored(ctx, prompts, responses, logp_roll)


@torch.no_grad()
def scored(
    ctx: RLContext, prompts: torch.Tensor, responses: torch.Tensor, logp_roll: torch.Tensor
) -> Rollouts:
    """Sampled responses (by this process or by a rollout engine) -> Rollouts: logp_old from the training
    forward under the current weights, rewards and group advantages."""
    cfg, model, d = ctx.cfg, ctx.model, ctx.dist
    ctx.probe.active = ctx.balancer.active = False
    model.train()
    logp_old = torch.empty_like(logp_roll)
    for rows in minibatch_rows(prompts.shape[0], cfg.minibatches):
        logp_old[rows] = sequence_logprobs(model, prompts[rows], responses[rows], cfg.temperature)
    if d is not None:
        d.reshard(model)  # no-grad forwards left the root unit gathered
    rewards = prompt_bytes_reward(prompts, responses).to(logp_roll.device)
    advantages = group_advantages(rewards, cfg.group_size)
    return Rollouts(prompts, responses, logp_roll, logp_old, rewards, advantages)


def minibatch_loss(
    ctx: RLContext, ro: Rollouts, rows: slice, forward: Callable = contextlib.nullcontext
) -> tuple[torch.Tensor, IcePopStats, torch.Tensor]:
    """IcePop loss of minibatch `rows` under the current weights: (loss, stats, PPO ratio [rows, N]);
    `forward()`: the context of the forward (the layout-invariant mode, or nothing)."""
    cfg = ctx.cfg
    with forward():
        logp = sequence_logprobs(ctx.model, ro.prompts[rows], ro.responses[rows], cfg.temperature)
    loss, stats = icepop_loss(logp, ro.logp_old[rows], ro.logp_rollout[rows], ro.advantages[rows])
    return loss, stats, torch.exp(logp.detach() - ro.logp_old[rows])


def rl_step(ctx: RLContext, step: int) -> dict:
    """One RL step (module docstring) -> its metrics record."""
    cfg = ctx.cfg
    t0 = time.perf_counter()
    lr = cfg.lr_at(step)
    for o in ctx.optimizers:
        for g in o.param_groups:
            g["lr"] = lr
    return update(ctx, collect(ctx, step), step, lr, t0)


def update(
    ctx: RLContext,
    ro: Rollouts,
    step: int,
    lr: float,
    t0: float,
    forward: Callable = contextlib.nullcontext,
) -> dict:
    """The IcePop updates of step `step` on `ro` -> the step's metrics record (`forward` as in
    `minibatch_loss`)."""
    cfg = ctx.cfg
    ctx.probe.reset()
    ctx.probe.active = ctx.balancer.active = True
    losses, clipped, gnorms, violations = [], [], [], []
    r_min, r_max = float("inf"), float("-inf")
    for _ in range(cfg.ppo_epochs):
        for rows in minibatch_rows(ro.responses.shape[0], cfg.minibatches):
            loss, st, ratio = minibatch_loss(ctx, ro, rows, forward)
            loss.backward()
            gnorms.append(float(ctx.clip_gradients()))
            for o in ctx.optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            violations.append(ctx.balancer.update())
            losses.append(st.loss)
            clipped.append(st.clipped)
            r_min, r_max = min(r_min, float(ratio.min())), max(r_max, float(ratio.max()))
    k = torch.exp(ro.logp_old - ro.logp_rollout)  # the mismatch pop() acts on (fixed for the step)
    n_tok = ro.responses.numel()
    return {
        "step": step + 1,
        "loss": sum(losses) / len(losses),
        "reward_mean": float(ro.rewards.mean()),
        "reward_std": float(ro.rewards.std(unbiased=False)),
        "popped": float((pop(k) == 0).float().mean()),  # k > 0: pop(k) is 0 exactly outside the band
        "clipped": sum(clipped) / len(clipped),
        "mismatch_min": float(k.min()),
        "mismatch_max": float(k.max()),
        "mismatch_outside": float(((k < 0.5) | (k > 2.0)).float().mean()),  # pi_train / pi_rollout
        "ppo_ratio_min": r_min,
        "ppo_ratio_max": r_max,
        "lr": lr,
        "grad_norm": sum(gnorms) / len(gnorms),
        "max_attn_logit": max(ctx.probe.max_logits) if ctx.probe.max_logits else None,
        "moe_max_violation": sum(violations) / len(violations),
        "response_tokens": n_tok,
        "tokens": (step + 1) * n_tok,
        "step_s": time.perf_counter() - t0,
    }


def check_rl_options(cfg: TrainConfig) -> None:
    """The RL options' ranges (ValueError naming the option)."""
    from glm5.train.rl.rollout import PRECISIONS

    bad = [
        (name, want)
        for name, ok, want in (
            ("group_size", cfg.group_size >= 2, ">= 2 (advantages are relative to the group)"),
            ("prompt_len", cfg.prompt_len >= 1, ">= 1"),
            ("response_len", cfg.response_len >= 1, ">= 1"),
            ("ppo_epochs", cfg.ppo_epochs >= 1, ">= 1"),
            (
                "minibatches",
                cfg.minibatches >= 1 and (cfg.batch_size * cfg.group_size) % cfg.minibatches == 0,
                "a divisor of batch_size * group_size",
            ),
            ("temperature", cfg.temperature > 0, "> 0"),
            ("rollout_precision", cfg.rollout_precision in PRECISIONS, f"one of {PRECISIONS}"),
            ("rollout_engine", cfg.rollout_engine in ROLLOUT_ENGINES, f"one of {ROLLOUT_ENGINES}"),
            ("push_every", cfg.push_every >= 1, ">= 1"),
            (
                "max_staleness",
                cfg.max_staleness >= cfg.push_every - 1,
                f">= push_every - 1 = {cfg.push_every - 1} (a batch of step n waits for version n - "
                "max_staleness, which the pushes every push_every steps reach only then)",
            ),
            ("engine_tp", cfg.engine_tp >= 1, ">= 1"),
            (
                "layout_invariant",
                not cfg.layout_invariant or cfg.rollout_engine != "sync",
                "a rollout engine (--rollout-engine policy|vllm; the sync stage's rollout check has its own)",
            ),
            (
                "rollout_precision",
                cfg.rollout_engine == "sync" or cfg.rollout_precision == "bf16",
                "bf16 with a rollout engine (the engine samples in its own precision)",
            ),
        )
        if not ok
    ]
    if bad:
        name, want = bad[0]
        raise ValueError(f"{name}: expected {want}, got {getattr(cfg, name)!r}")
