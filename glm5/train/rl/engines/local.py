"""The rollout-engine interface of asynchronous RL (glm5/train/rl/asynchronous.py) and its in-process engine.

An engine is token in, token out: `generate` takes prompt token ids and returns the sampled token ids,
their log-probs under the engine's weights at the sampling temperature, and the policy version of those
weights; `push` replaces the weights in place under their checkpoint names (experts unstacked, as
glm5/core/checkpoint.py stores them) and sets the version; `close` ends it. `PolicyEngine` is the project's
own decode path (glm5/train/rl/rollout.py: prefill, then one cached token per step) on a private whole copy of
the policy; `glm5.train.rl.engines.vllm_engine.VllmEngine` is vLLM with the project's plugin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from glm5.core.checkpoint import state_hf_names

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class Generation:
    responses: torch.Tensor  # int64 [R, N]
    logprobs: torch.Tensor  # fp32 [R, N], the engine's log-probs of the sampled tokens
    version: int  # the policy version (optimizer steps done) of the weights that sampled
    # with top-k recording: int32 [R, N, indexer layers, index_topk] (-1 padded), the keys each indexer
    # layer selected for the query that produced each sampled token (glm5/train/rl/topk_replay.py)
    topk: torch.Tensor | None = None


class RolloutEngine(Protocol):
    version: int

    def generate(
        self, prompts: torch.Tensor, new_tokens: int, *, temperature: float, seed: int
    ) -> Generation: ...

    def push(self, named: NamedTensors, version: int) -> None: ...

    def close(self) -> None: ...


def checkpoint_tensors(state: dict[str, torch.Tensor], tied: bool) -> NamedTensors:
    """A whole model's state dict -> (checkpoint name, CPU copy) pairs: stacked experts unstacked, a tied
    head left out (what `update_weights` of the vLLM plugin and `PolicyEngine.push` take)."""
    return [
        (hf, (state[name] if e is None else state[name][e]).detach().to("cpu").clone())
        for hf, name, e in state_hf_names(state, tied)
    ]


def policy_tensors(trainer) -> NamedTensors | None:
    """The trainer's current weights as checkpoint-named whole tensors: on one process, or gathered from
    every rank's shards (a collective: every rank calls it); None on the ranks other than 0."""
    model, d = trainer.model, trainer.dist
    tied = model.config.tie_word_embeddings
    if d is None:
        return checkpoint_tensors(model.state_dict(), tied)
    from glm5.train.distributed.checkpoint import _model_state
    from glm5.train.distributed.runtime import full

    state = {k: full(v) for k, v in _model_state(model, d.plan_mesh).items()}
    return checkpoint_tensors(state, tied) if d.rank == 0 else None


class PolicyEngine:
    """The project's decode path as a rollout engine, on its own whole copy of the policy (so the trainer
    may change its weights while this samples); `push` copies new weights into that copy."""

    def __init__(
        self,
        config,
        backend: str | None,
        named: NamedTensors,
        version: int = 0,
        invariant: bool = False,
        record_topk: bool = False,
    ) -> None:
        from glm5.core.model import GLM5ForCausalLM
        from glm5.weights.load import CheckpointNames  # torch only: importing it does not import vLLM

        self.model = GLM5ForCausalLM(config, backend=backend).requires_grad_(False).eval()
        self.names = CheckpointNames(self.model)
        self.invariant = invariant  # sample in the layout-invariant mode (SPEC 12)
        self.record_topk = record_topk  # return the indexer top-k per generated token
        self.pushes = 0
        self.push(named, version)
        self.pushes = 0  # the initial weights are not a push

    def generate(
        self, prompts: torch.Tensor, new_tokens: int, *, temperature: float, seed: int
    ) -> Generation:
        from glm5.train.rl.rollout import batch_invariant, sample
        from glm5.train.rl.topk_replay import recording

        g = torch.Generator().manual_seed(seed)
        dev = self.model.backend.device
        record = recording(self.model, prompts.shape[1]) if self.record_topk else contextlib.nullcontext()
        with batch_invariant(self.model) if self.invariant else contextlib.nullcontext(), record as topk:
            responses, logp = sample(
                self.model, prompts.to(dev), new_tokens, temperature=temperature, generator=g
            )
        return Generation(responses.cpu(), logp.float().cpu(), self.version, topk[0] if topk else None)

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from glm5.weights.load import load

        load(self.model, self.names, named)
        self.model.prepare_weights()
        self.version = version
        self.pushes += 1

    def close(self) -> None:
        self.model = None
