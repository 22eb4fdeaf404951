"""`--mesh dp=2,ep=2` on 2 gloo ranks: the experts across the data-parallel ranks (each rank half the batch
and half the experts, the routed rows dispatched between them, SPEC 11.1) against one process over the
same micro-batches (loss and every gradient), a 3-step Trainer run against the dp=2 run of the same
batches, and the mesh checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.train.distributed.mesh import Mesh, check_mesh
from glm5.train.distributed.runtime import Dist, full
from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.glm5.train._dist import spawn
from tests.glm5.train.distributed.test_fsdp import BATCH, _ids, _model, _objective

MESH = Mesh(dp=2, ep=2)
CFG = TrainConfig(
    steps=3,
    batch_size=4,
    seq_len=32,
    lr=1e-2,
    warmup_steps=2,
    eval_every=3,
    eval_batches=1,
    save_every=3,
    max_bytes=256 << 10,
    deterministic=True,
)


def _worker(rank: int, world: int, out: str) -> None:
    model = _model()
    d = Dist.setup(MESH, 2, torch.device("cpu"))
    d.shard(model)
    loss = _objective(model, d.local_batch(_ids()))
    loss.backward()
    grads = {n: full(p.grad).contiguous() for n, p in model.named_parameters() if p.grad is not None}
    experts = sorted(n for n, _ in model.named_parameters() if n in model.glm5_plan)
    save_file({**grads, "__loss__": loss.detach().reshape(1)}, f"{out}/rank{rank}.safetensors")
    if rank == 0:
        with open(f"{out}/experts.json", "w") as f:
            json.dump(experts, f)
    Trainer(CFG, f"{out}/epdp", mesh=MESH, zero=2).run(progress=False)
    Trainer(CFG, f"{out}/dp", mesh=Mesh(dp=world), zero=2).run(progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("epdp")
    spawn(_worker, 2, str(out))
    return out


def test_loss_and_every_gradient_match_one_process_over_the_same_micro_batches(run):
    ids = _ids()
    micro = []
    for r in range(2):
        model = _model()
        loss = _objective(model, ids[r * BATCH // 2 : (r + 1) * BATCH // 2])
        loss.backward()
        micro.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    experts = set(json.loads((run / "experts.json").read_text()))
    assert experts and all(".mlp.experts." in n for n in experts)
    e = _model().config.n_routed_experts
    for r in range(2):
        got = load_file(run / f"rank{r}.safetensors")
        # the rank's tokens: its loss (the experts' GEMMs of the cpu backend block by their row count, so
        # a tolerance: the rows an expert gets now come from both ranks)
        torch.testing.assert_close(got.pop("__loss__")[0], micro[r][0], rtol=1e-5, atol=1e-6)
        ref = {n: micro[0][1][n] / 2 + micro[1][1][n] / 2 for n in micro[0][1]}  # the mean of the losses
        assert sorted(got) == sorted(ref)
        for name, g in got.items():
            want = ref[name]
            if name in experts:  # the rank's own half of the experts, with both ranks' tokens
                want = want[r * e // 2 : (r + 1) * e // 2]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)


def test_a_run_follows_the_dp_run_of_the_same_batches(run):
    def records(name):
        return [json.loads(ln) for ln in (run / name / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(records("epdp"), records("dp"), strict=True):
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(b[key]), (a["step"], key, a[key], b[key])
    assert (run / "epdp" / "checkpoints" / "latest" / "model").is_dir()


def test_the_mesh_borrows_the_dp_ranks_and_refuses_what_it_cannot_run():
    assert MESH.size == 2 and MESH.ep_over_dp
    check_mesh(MESH, 2)
    with pytest.raises(ValueError, match=r"^ep=2 with dp=4: experts across the data-parallel ranks need ep"):
        check_mesh(Mesh(dp=4, ep=2), 4)
    with pytest.raises(ValueError, match=r"ep borrows the dp ranks\), expected --nproc \(4\)"):
        check_mesh(MESH, 4)
