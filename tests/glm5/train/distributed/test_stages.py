"""The DSA warm-up and the RL stage at dp=2 (FSDP2, 2 gloo ranks): the warm-up's indexer gradients
bitwise equal to the 1-process runs over the same micro-batches averaged (the indexers stay out of FSDP2,
whose backward hooks the KL-only loss never reaches); RL: each rank samples its own prompts' rollouts and
the IcePop gradient over the global batch equals the 1-process gradients over the same rollouts
averaged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.train.distributed.mesh import Mesh
from glm5.train.distributed.runtime import Dist, full
from glm5.train.loop.dsa import AttentionProbe
from glm5.train.loop.losses import lm_and_mtp
from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.rl.stage import Rollouts, collect, minibatch_loss
from tests.glm5.train._dist import spawn
from tests.glm5.train.distributed.test_fsdp import BATCH, _ids, _model

RL = TrainConfig(
    stage="rl",
    steps=1,
    batch_size=2,
    group_size=2,
    prompt_len=8,
    response_len=4,
    eval_every=1,
    eval_batches=1,
    max_bytes=256 << 10,
    deterministic=True,
    seq_len=16,
)
FIELDS = ("prompts", "responses", "logp_rollout", "logp_old", "rewards", "advantages")


def _warmup_grads(model, ids, d=None) -> dict[str, torch.Tensor]:
    probe = AttentionProbe(model, stage="warmup")
    lm_and_mtp(model, ids, 1)
    probe.remove()
    probe.kl_loss().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    if d is not None:
        d.sync_replicated_grads(params)
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _freeze_base(model):
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n)
    return model


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    model = _freeze_base(_model())
    d = Dist.setup(Mesh(dp=world), 3, torch.device("cpu"))
    d.shard(model, frozen_base=True)
    grads = _warmup_grads(model, d.local_batch(_ids()), d)
    if rank == 0:
        save_file(grads, f"{out}/warmup.safetensors")
    trainer = Trainer(RL, f"{out}/rl", mesh=Mesh(dp=world))
    ro = collect(trainer, 0)
    loss, _, _ = minibatch_loss(trainer, ro, slice(None))
    loss.backward()
    grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
    parts = [None] * world
    dist.all_gather_object(parts, {f: getattr(ro, f) for f in FIELDS})
    for o in trainer.optimizers:
        o.zero_grad(set_to_none=True)
    trainer.run(progress=False)
    if rank == 0:
        save_file(grads, f"{out}/rl.safetensors")
        save_file(
            {f"{r}/{f}": t.contiguous() for r, p in enumerate(parts) for f, t in p.items()},
            f"{out}/rollouts.safetensors",
        )


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    out = tmp_path_factory.mktemp("stages")
    spawn(_worker, 2, str(out))
    return out


def test_warmup_at_dp2_indexer_gradients_bitwise_equal_to_one_process_over_the_same_micro_batches(stages):
    got = load_file(stages / "warmup.safetensors")
    ids = _ids()
    half = BATCH // 2
    micro = [_warmup_grads(_freeze_base(_model()), ids[r * half : (r + 1) * half]) for r in range(2)]
    ref = {n: micro[0][n] / 2 + micro[1][n] / 2 for n in micro[0]}
    assert sorted(got) == sorted(ref) and ref and all(".indexer." in n for n in ref)
    assert not [n for n in ref if not torch.equal(got[n], ref[n])]


def test_rl_at_dp2_samples_per_rank_and_its_gradient_is_the_mean_of_the_ranks_one_process_gradients(
    stages, tmp_path
):
    saved = load_file(stages / "rollouts.safetensors")
    parts = [Rollouts(**{f: saved[f"{r}/{f}"] for f in FIELDS}) for r in range(2)]
    assert not torch.equal(parts[0].prompts, parts[1].prompts)  # each rank its own prompts
    got = load_file(stages / "rl.safetensors")
    grads = []
    for r, ro in enumerate(parts):
        trainer = Trainer(dataclasses.replace(RL), tmp_path / f"one{r}")
        loss, _, _ = minibatch_loss(trainer, ro, slice(None))
        loss.backward()
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None})
    ref = {n: grads[0][n] / 2 + grads[1][n] / 2 for n in grads[0]}
    assert sorted(got) == sorted(ref)
    assert not [n for n in ref if ".indexer." in n]  # the indexer is frozen during RL: no gradient
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not bad, bad
    assert (stages / "rl" / "summary.json").exists()
