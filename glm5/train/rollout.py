"""The rollout-versus-training check of RL: sample with the decode path (KV caches, one token per step),
recompute the sampled tokens' log-probs with the training forward (whole sequences, no cache) and report
the ratio pi_train / pi_rollout: min, max and the share outside [1/2, 2] (the band IcePop keeps).

The two paths run the same ops on different numbers of rows (1 per decode step, S in training). A matrix
kernel may pick another blocking, hence another summation order, for another row count, so the ratio is
1 only up to rounding. `batch_invariant()` removes that source: every matrix product is computed one
output row at a time, so a row's result no longer depends on how many rows share the call. The indexer
top-k and MoE routing are deterministic by contract (SPEC 2.3), so with it the reference backend gives a
ratio of exactly 1.

`rollout_precision="fp8"` samples with an FP8 copy of the policy instead (quant/fp8.py) and reports the
FP8-vs-bf16 mismatch IcePop's pop() exists to contain (glm5/train/icepop.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5.model import GLM5ForCausalLM

aten = torch.ops.aten


def _rowwise_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[1]))
    return torch.cat([torch.mm(a[i : i + 1], b) for i in range(a.shape[0])])


# Vectorised transcendental kernels round differently in their SIMD body and their remainder loop, so an
# element's result can depend on where the tensor's length puts it; these run one leading-axis slice
# at a time.
_ELEMENTWISE = {
    aten.exp.default,
    aten.log.default,
    aten.sigmoid.default,
    aten.silu.default,
    aten.rsqrt.default,
    aten.tanh.default,
    aten.sin.default,
    aten.cos.default,
    aten.log1p.default,
    aten.expm1.default,
}
# Reductions along non-leading axes: split along the leading axis as well.
_REDUCTIONS = {
    aten._softmax.default: 1,
    aten._log_softmax.default: 1,
    aten.logsumexp.default: 1,
    aten.sum.dim_IntList: 1,
    aten.mean.dim: 1,
}


def _sliced(func, x: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor:
    return torch.cat([func(x[i : i + 1], *rest, **kwargs) for i in range(x.shape[0])])


def _leading_free(x: torch.Tensor, dims) -> bool:
    if dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return bool(dims) and all(d % x.dim() != 0 for d in dims)


class _BatchInvariantMatmul(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        splittable = isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] > 1
        if splittable and func in _ELEMENTWISE:
            return _sliced(func, x, args[1:], kwargs)
        if splittable and func in _REDUCTIONS and _leading_free(x, args[_REDUCTIONS[func]]):
            return _sliced(func, x, args[1:], kwargs)
        if func is aten.mm.default:
            return _rowwise_mm(*args)
        if func is aten.addmm.default:
            bias, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            return beta * bias + alpha * _rowwise_mm(a, b)
        if func is aten.bmm.default:
            a, b = args
            if a.shape[0] == 0:
                return a.new_empty((0, a.shape[1], b.shape[2]))
            return torch.stack([_rowwise_mm(a[i], b[i]) for i in range(a.shape[0])])
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Matrix products (mm, addmm, bmm) computed row by row: results independent of the row count.
    Slow (one kernel call per row); meant for checks, not for throughput."""
    with _BatchInvariantMatmul():
        yield


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
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
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
    return torch.log_softmax(logits.float() / temperature, -1).gather(2, sampled[..., None])[..., 0]


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
    ctx = batch_invariant() if invariant else contextlib.nullcontext()
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
        out["fp8_calls"] = dict(policy.backend.fp8_calls)
        be = policy.backend.inner
        out["fp8_backend"] = be.name + (
            "" if be is model.backend else f" ({model.backend.name} has no FP8 ops)"
        )
    return out


@torch.no_grad()
def topk_overlap(model: GLM5ForCausalLM, policy: GLM5ForCausalLM, ids: torch.Tensor) -> float:
    """Mean over indexer layers and query tokens of |S_bf16 & S_fp8| / |S_bf16|: the indexer's selected key
    sets of the bf16 model and of its FP8 policy, both run as one forward over `ids` [B, S]."""
    from quant.fp8 import FP8AttentionBackend

    inner = model.backend
    model.backend = rec = FP8AttentionBackend(inner, fp8=False)
    try:
        model(ids)
    finally:
        model.backend = inner
    policy.backend.selections.clear()
    policy(ids)
    shares = []
    for a, b in zip(rec.selections, policy.backend.selections, strict=True):
        for ra, rb in zip(a.tolist(), b.tolist(), strict=True):
            sa = {i for i in ra if i >= 0}
            if sa:
                shares.append(len(sa & {i for i in rb if i >= 0}) / len(sa))
    return sum(shares) / len(shares) if shares else 1.0
