"""IcePop: the RL objective GLM-5 trains with when rollouts run in another precision than training
(FP8 engines vs the bf16 training forward), as in GLM-5's report and inclusionAI's IcePop.

For each sampled token t with advantage A_t:
    k_t   = pi_train_old(y_t) / pi_rollout(y_t)        training-inference mismatch (no gradient)
    pop(k) = k if 1/beta <= k <= beta else 0             beta = 2: tokens outside [1/2, 2] are dropped
    r_t   = pi_theta(y_t) / pi_train_old(y_t)            the PPO ratio
    J     = mean_t pop(k_t) * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
with eps_low = 0.2, eps_high = 0.28 (decoupled clip). The loss is -J, a token-level mean over the
response mask. `group_advantages` is GRPO's per-prompt standardisation of scalar rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BETA = 2.0
CLIP_LOW = 0.2
CLIP_HIGH = 0.28


def pop(k: torch.Tensor, beta: float = BETA) -> torch.Tensor:
    """k where 1/beta <= k <= beta, else 0 (the token leaves the gradient)."""
    return torch.where((k >= 1.0 / beta) & (k <= beta), k, torch.zeros_like(k))


@dataclass
class IcePopStats:
    loss: float
    popped: float  # share of response tokens whose mismatch ratio left [1/beta, beta]
    clipped: float  # share of response tokens whose PPO ratio was clipped (gradient zero)
    mismatch_min: float
    mismatch_max: float


def icepop_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = BETA,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
) -> tuple[torch.Tensor, IcePopStats]:
    """logp: [B, N] log pi_theta of the sampled tokens (differentiable); logp_old: the training policy's
    log-probs when the batch was sampled; logp_rollout: the rollout engine's; advantages: [B, N] or [B];
    mask: [B, N] response tokens (default all). Returns (loss, stats)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
    k = torch.exp(logp_old.detach().float() - logp_rollout.detach().float())
    w = pop(k, beta)
    r = torch.exp(logp.float() - logp_old.detach().float())
    a = advantages.float()
    surr = torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
    n = mask.sum().clamp(min=1)
    loss = -(w * surr * mask).sum() / n
    clipped = ((r * a) > (torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)) & mask
    km = k[mask]
    stats = IcePopStats(
        loss=float(loss.detach()),
        popped=float(((w == 0) & mask).sum() / n),
        clipped=float(clipped.sum() / n),
        mismatch_min=float(km.min()) if km.numel() else 1.0,
        mismatch_max=float(km.max()) if km.numel() else 1.0,
    )
    return loss, stats


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * group_size] (responses of one prompt adjacent) -> advantages standardised per group."""
    r = rewards.float().reshape(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)).reshape(-1)
