"""Sequence parallel for the norms (`--mesh tp=2,sp=2`, glm5/parallel/sequence.py) on 2 gloo ranks against
plain tp=2 over the same batch: each decoder norm sees half the tokens, the loss has the same bits (at 2
ranks every sum over the group has two terms, so its order cannot matter, and a norm and a residual add
are row-wise), every gradient follows within a tolerance (the norm weights' gradients are the sum of two
half-token sums instead of one sum), the norm weights' gradients agree on both ranks once the trainer
summed them (their Layout marks them partial), and a 2-step Trainer run keeps every copy equal on both
ranks; the refused meshes in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from glm5.cli import main
from glm5.parallel.group import Single, TorchGroup
from glm5.parallel.plan import PlanError, apply
from glm5.train.distributed.mesh import Mesh, check_mesh
from glm5.train.distributed.runtime import Dist
from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.glm5.train._dist import spawn
from tests.glm5.train.distributed.test_fsdp import BATCH, SEQ, _ids, _model, _objective

CFG = TrainConfig(
    steps=2, batch_size=BATCH, seq_len=SEQ, lr=1e-2, warmup_steps=2, eval_every=2, eval_batches=1,
    save_every=2, max_bytes=256 << 10, deterministic=True,
)  # fmt: skip


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    ids = _ids()
    for name, mesh in (("tp", Mesh(tp=world)), ("sp", Mesh(tp=world, sp=world))):
        model = _model()
        d = Dist.setup(mesh, 2, torch.device("cpu"))
        d.shard(model)
        rows: list[int] = []
        norm = model.model.layers[0].post_attention_layernorm
        handle = norm.register_forward_pre_hook(lambda m, a, rows=rows: rows.append(a[0].shape[0]))
        loss = _objective(model, ids)
        handle.remove()
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        d.sync_replicated_grads(params)  # (what clip_grad_norm does first): the partial norm gradients
        plan = model.glm5_plan
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            info = plan.get(n)
            g = p.grad if info is None else TorchGroup().all_gather(p.grad.contiguous(), info.dim)
            grads[n] = g.contiguous()
        partial = {n: g for n, g in grads.items() if plan.layout(n).partial is not None}
        others = [None] * world
        dist.all_gather_object(others, partial)
        same = all(torch.equal(o[n], g) for o in others for n, g in partial.items())
        if rank == 0:
            save_file({**grads, "__loss__": loss.detach().reshape(1)}, f"{out}/{name}.safetensors")
            meta = {"rows": rows[0], "partial": sorted(plan.partial), "same_on_ranks": same}
            with open(f"{out}/{name}.json", "w") as f:
                json.dump(meta, f)
    # the Trainer: 2 steps; every copy (the norms above all) must stay equal on both ranks
    trainer = Trainer(CFG, f"{out}/run-sp", mesh=Mesh(tp=world, sp=world))
    trainer.run(progress=False)
    plan = trainer.model.glm5_plan
    copies = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in plan}
    others = [None] * world
    dist.all_gather_object(others, copies)
    if rank == 0:
        same = sorted(n for n, v in copies.items() if all(torch.equal(o[n], v) for o in others))
        with open(f"{out}/run-sp.json", "w") as f:
            json.dump({"copies": len(copies), "same": len(same), "norms": sorted(plan.partial)}, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    spawn(_worker, 2, str(out))
    return out


def test_the_norms_see_half_the_tokens_and_the_loss_keeps_its_bits(run):
    tp, sp = (json.loads((run / f"{k}.json").read_text()) for k in ("tp", "sp"))
    assert tp["rows"] == BATCH * SEQ and sp["rows"] == BATCH * SEQ // 2
    layers = _model().config.num_hidden_layers
    assert tp["partial"] == [] and len(sp["partial"]) == 2 * layers  # each main layer's two norms
    a, b = load_file(run / "tp.safetensors"), load_file(run / "sp.safetensors")
    assert torch.equal(a["__loss__"], b["__loss__"])


def test_every_gradient_follows_plain_tp_and_the_norm_gradients_agree_on_both_ranks(run):
    a, b = load_file(run / "tp.safetensors"), load_file(run / "sp.safetensors")
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-6, msg=n)
    assert json.loads((run / "sp.json").read_text())["same_on_ranks"]


def test_the_trainer_runs_it_and_every_copy_stays_equal_on_both_ranks(run):
    records = [json.loads(ln) for ln in (run / "run-sp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, CFG.steps + 1))
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)  # finite, trained
    meta = json.loads((run / "run-sp.json").read_text())
    # a norm gradient left unsummed would update each rank's copy with its own half of the tokens
    assert meta["norms"] and meta["same"] == meta["copies"]
    assert (run / "run-sp" / "checkpoints" / "latest" / "model").is_dir()


def test_refused_meshes_name_the_reason():
    with pytest.raises(ValueError, match="sp=2: sequence parallel runs over the tp ranks, expected tp=2"):
        check_mesh(Mesh(dp=2, sp=2), 2)
    with pytest.raises(PlanError, match="sequence_parallel: runs over the tp group"):
        apply(_model(), tp=Single(), sequence_parallel=True)


@pytest.mark.parametrize(
    "args, hint, msg",
    [
        (["--mesh", "tp=2,sp=2", "--seq-len", "33", "--batch-size", "1"], "'--seq-len'", "does not divide"),
        (["--mesh", "tp=2,sp=2", "--stage", "rl"], "'--mesh'", "sequence parallel splits a step's tokens"),
    ],
)
def test_bad_sequence_parallel_options_are_one_line_exit_2(tmp_path, args, hint, msg):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--out", str(out), "--steps", "1", "--nproc", "2", *args])
    assert res.exit_code == 2, res.output
    error = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(error) == 1 and hint in error[0] and msg in error[0], res.output
    assert not out.exists()
