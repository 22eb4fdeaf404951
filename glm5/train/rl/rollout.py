"""The rollout-versus-training check of RL: sample with the decode path (KV caches, one token per step),
recompute the sampled tokens' log-probs with the training forward (whole sequences, no cache) and report
the ratio pi_train / pi_rollout: min, max and the share outside [1/2, 2] (the band IcePop keeps).

The two paths run the same ops on different numbers of rows (1 per decode step, S in training). A matrix
kernel may pick another blocking, hence another summation order, for another row count, so the ratio is
1 only up to rounding. `batch_invariant()` removes that source: it is the layout-invariant mode (SPEC 12:
exact matrix products, fixed reduction trees, transcendentals by fixed formulas), so a row's bits depend
on neither the row count nor the parallel layout, and the reference and cpu backends give a ratio of
exactly 1.

`rollout_precision="fp8"` samples with an FP8 copy of the policy instead (quant/fp8.py) and reports the
FP8-vs-bf16 mismatch IcePop's pop() exists to contain (glm5/train/rl/icepop.py).
"""

from __future__ import annotations

import contextlib

import torch

from glm5.core.model import GLM5ForCausalLM, logprobs
from glm5.parallel.invariant import layout_invariant


def batch_invariant(model: GLM5ForCausalLM | None = None) -> contextlib.AbstractContextManager:
    """The layout-invariant mode (glm5/parallel/invariant.py, SPEC 12): a row's bits do not depend on
    how many rows share the call (nor on the parallel layout), with `model`'s backend checked for it."""
    return layout_invariant(None if model is None else model.backend)


PRECISIONS = ("bf16", "fp8")


def rollout_policy(model: GLM5ForCausalLM, precision: str) -> GLM5ForCausalLM:
    """What samples: `model` itself ("bf16"), or an FP8 copy of its current weights ("fp8")."""
    if precision not in PRECISIONS:
        raise ValueError(f"rollout_precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return model
    from quant.fp8 import fp8_policy  # quantization is applied from outside the model core

    return fp8_policy(model)


@torch.no_grad()
def sample(
    policy: GLM5ForCausalLM,
    prompts: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout engine: prompts int64 [B, P] -> (sampled [B, N], their log-probs under `policy` at
    `temperature`, fp32 [B, N]), through the decode path (prefill, then one cached token per step)."""
    b, p = prompts.shape
    cache = policy.new_cache(b, p + new_tokens)
    logits = policy(prompts, cache).logits[:, -1]  # [B, V]
    toks, logp_roll = [], []
    for i in range(new_tokens):
        logp = logprobs(logits, temperature)
        t = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(logp.device)  # [B, 1]
        toks.append(t[:, 0])
        logp_roll.append(logp.gather(1, t)[:, 0])
        if i + 1 < new_tokens:
            logits = policy(t, cache).logits[:, -1]
    return torch.stack(toks, 1), torch.stack(logp_roll, 1)


def sequence_logprobs(
    model: GLM5ForCausalLM, prompts: torch.Tensor, sampled: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The training forward (whole sequences, no cache): log pi(sampled) fp32 [B, N] at `temperature`,
    differentiable when grad is enabled."""
    p = prompts.shape[1]
    logits = model(torch.cat([prompts, sampled], 1)[:, :-1]).logits[:, p - 1 :]  # [B, N, V]
    return logprobs(logits, temperature).gather(2, sampled[..., None])[..., 0]


@torch.no_grad()
def rollout_check(
    model: GLM5ForCausalLM,
    prompts: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    invariant: bool = True,
    rollout_precision: str = "bf16",
) -> dict:
    """prompts int64 [B, P] -> ratio statistics over the B * new_tokens sampled tokens (and the tokens).

    rollout_precision "fp8": sample with `quant.fp8.fp8_policy(model)` (FP8 linears and experts, the FP8
    indexer, the FP8 latent cache: what an FP8 engine serves) and recompute with the bf16 `model`; the
    result then also gives the indexer top-k set overlap between the two passes over the same tokens."""
    if new_tokens < 1 or temperature <= 0:
        raise ValueError(f"new_tokens/temperature: expected >= 1 and > 0, got {new_tokens}, {temperature}")
    policy = rollout_policy(model, rollout_precision)  # refuses an unknown precision
    g = torch.Generator().manual_seed(seed)
    ctx = batch_invariant(model) if invariant else contextlib.nullcontext()
    with ctx:
        sampled, logp_roll_t = sample(policy, prompts, new_tokens, temperature=temperature, generator=g)
        logp_train = sequence_logprobs(model, prompts, sampled, temperature)
    full = torch.cat([prompts, sampled], 1)
    ratio = torch.exp(logp_train - logp_roll_t)
    out = {
        "rollout_precision": rollout_precision,
        "tokens": int(ratio.numel()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "outside_half_to_two": float(((ratio < 0.5) | (ratio > 2.0)).float().mean()),
        "max_abs_logprob_diff": float((logp_train - logp_roll_t).abs().max()),
        "bitwise_equal": bool(torch.equal(logp_train, logp_roll_t)),
        "batch_invariant": invariant,
        "sampled": sampled.tolist(),
    }
    if rollout_precision == "fp8":
        out["topk_overlap"] = topk_overlap(model, policy, full)
        c = policy.config
        fmt = policy.cache_format
        out["fp8_cache"] = {
            "kv_cache_dtype": policy.kv_cache_dtype,
            "latent": "656-byte rows"
            if fmt.fp8_rows(c.kv_lora_rank + c.qk_rope_head_dim)
            else f"simulated in {policy.dtype} (widths {c.kv_lora_rank} + {c.qk_rope_head_dim})",
            "index_k": f"fp8 rows of {c.index_head_dim} + 4 bytes",
        }
        be = policy.backend  # model.backend, or the reference's
        out["fp8_backend"] = be.name + (
            "" if be.name == model.backend.name else f" ({model.backend.name} has no FP8 ops)"
        )
    return out


@torch.no_grad()
def topk_overlap(model: GLM5ForCausalLM, policy: GLM5ForCausalLM, ids: torch.Tensor) -> float:
    """Mean over indexer layers and query tokens of |S_bf16 & S_fp8| / |S_bf16|: the indexer's selected key
    sets of the bf16 model and of its FP8 policy, both run as one forward over `ids` [B, S]."""
    from backends.hooks import Recorder

    with model.backend.hooked(Recorder(["indexer_topk"])) as bf16:
        model(ids)
    with policy.backend.hooked(Recorder(["indexer_topk"])) as fp8:
        policy(ids)
    shares = []
    for a, b in zip(bf16.outputs("indexer_topk"), fp8.outputs("indexer_topk"), strict=True):
        for ra, rb in zip(a.tolist(), b.tolist(), strict=True):
            sa = {i for i in ra if i >= 0}
            if sa:
                shares.append(len(sa & {i for i in rb if i >= 0}) / len(sa))
    return sum(shares) / len(shares) if shares else 1.0
