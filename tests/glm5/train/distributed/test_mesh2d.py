"""A 2-D mesh dp=2 x tp=2 on 4 gloo ranks (the one 4-process test of this file): loss and gradients
against the 1-process run over the same micro-batches (tolerance: tensor parallel sums heads and the
row-parallel partial products in another order), DistributedMuon bitwise equal to the 1-process Muon on
the same gradients (whole heads move nothing, one Newton-Schulz call per matrix over the whole mesh, the
bytes each rank moved equal the planned figure), and a checkpoint that resumes bit-exactly at 2-D and
loads at 1 process."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from glm5.train.distributed.mesh import Mesh
from glm5.train.distributed.runtime import Dist, full, state_bytes
from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.muon.layout import chunk_ranges
from glm5.train.muon.optimizer import build_optimizers
from tests.glm5.train._dist import spawn
from tests.glm5.train._runs import records
from tests.glm5.train.distributed.test_fsdp import BATCH, _ids, _model, _objective

MESH = Mesh(dp=2, tp=2)
CFG = TrainConfig(
    steps=2,
    batch_size=4,
    seq_len=32,
    lr=1e-2,
    warmup_steps=2,
    eval_every=1,
    eval_batches=1,
    save_every=1,
    max_bytes=256 << 10,
    deterministic=True,
)


def _whole(info, t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a rank's part `t` of a parameter the plan split as `info` (None: whole)
    (collectives: every rank calls it)."""
    from glm5.parallel.group import TorchGroup

    t = full(t)
    return t if info is None else TorchGroup(info.group.group).all_gather(t.contiguous(), info.dim)


def _synthetic(shape, k: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(77 + k))


def _part(p: torch.Tensor, info, g: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """Rank's part of a full tensor `g`, laid out as parameter `p` (plan slice `info`, then FSDP's chunk)."""
    if info is not None:
        g = g.narrow(info.dim, info.start, info.length)
    if not isinstance(p, DTensor):
        return g.clone()
    s, n = chunk_ranges(g.shape[0], p.device_mesh.size())[dp_rank]
    return DTensor.from_local(
        g.narrow(0, s, n).contiguous(),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    ids = _ids()
    model = _model()
    d = Dist.setup(MESH, 3, torch.device("cpu"))
    d.shard(model)
    loss = _objective(model, d.local_batch(ids))
    loss.backward()
    named = list(model.named_parameters())
    plan = model.glm5_plan
    grads = {n: _whole(plan.get(n), p.grad) for n, p in named if p.grad is not None}
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, loss.detach().reshape(1))
    # DistributedMuon on synthetic full gradients, each rank given its part
    opts = d.optimizers(model, "muon-split", 1e-2, 0.1)
    muon = opts[0]
    for k, (n, p) in enumerate(named):
        info = plan.get(n)
        p.grad = _part(p, info, _synthetic(_whole(info, p).shape, k), d.dp_rank) if p.requires_grad else None
    muon.step()
    after = {n: _whole(plan.get(n), p.detach()) for n, p in named}
    planned = muon.planned_bytes()
    stats = {
        "sent": muon.last_step_bytes.sent,
        "received": muon.last_step_bytes.received,
        "planned_sent": planned.sent,
        "ns_matrices": muon.ns_matrices,
        "bytes": state_bytes(model, opts),
    }
    all_stats = [None] * world
    dist.all_gather_object(all_stats, stats)
    if rank == 0:
        save_file({**grads, "__losses__": torch.cat(losses)}, f"{out}/grads.safetensors")
        save_file({n: t.contiguous() for n, t in after.items()}, f"{out}/after_muon.safetensors")
        Path(f"{out}/stats.json").write_text(json.dumps(all_stats))
    # a 2-step run, checkpoints at 1 and 2; then the run as it was after its step-1 save, resumed
    Trainer(CFG, f"{out}/run", mesh=MESH).run(progress=False)
    if rank == 0:
        shutil.copytree(f"{out}/run", f"{out}/resumed", symlinks=True)
        shutil.rmtree(f"{out}/resumed/checkpoints/step-000002")
        latest = Path(f"{out}/resumed/checkpoints/latest")
        latest.unlink()
        latest.symlink_to("step-000001")
    dist.barrier()
    Trainer(CFG, f"{out}/resumed", resume=True, mesh=MESH).run(progress=False)
    # 20 steps that train
    long = dataclasses.replace(CFG, steps=20, eval_every=20, save_every=20)
    Trainer(long, f"{out}/long", mesh=MESH).run(progress=False)
    # dp=4 on the same 4 processes: each rank's parameter + optimizer bytes after one step
    model = _model()
    d4 = Dist.setup(Mesh(dp=world), 3, torch.device("cpu"))
    d4.shard(model)
    _objective(model, d4.local_batch(ids)).backward()
    opts = d4.optimizers(model, "muon-split", 1e-3, 0.1)
    for o in opts:
        o.step()
    dp4 = [None] * world
    dist.all_gather_object(dp4, state_bytes(model, opts))
    if rank == 0:
        Path(f"{out}/dp4_bytes.json").write_text(json.dumps(dp4))


@pytest.fixture(scope="module")
def mesh2d(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh2d")
    spawn(_worker, 4, str(out))
    return out


def _one_process(ids):
    model = _model()
    loss = _objective(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_dp2_tp2_loss_and_gradients_follow_the_one_process_run_over_the_same_micro_batches(mesh2d):
    got = load_file(mesh2d / "grads.safetensors")
    losses = got.pop("__losses__")
    ids = _ids()
    micro = [_one_process(ids[r * BATCH // 2 : (r + 1) * BATCH // 2]) for r in range(2)]
    # ranks (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1): the tp ranks of a dp row compute the same loss
    want = torch.stack([micro[0][0], micro[0][0], micro[1][0], micro[1][0]])
    print(f"dp2 x tp2 losses per rank {losses.tolist()}, 1-process {want.tolist()}")
    assert torch.allclose(losses, want, rtol=1e-5, atol=0), (losses, want)
    ref = {n: micro[0][1][n] / 2 + micro[1][1][n] / 2 for n in micro[0][1]}
    assert sorted(got) == sorted(ref)
    rel = {n: float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n in ref}
    worst = max(rel, key=rel.get)
    print(f"dp2 x tp2: {len(ref)} gradients, worst relative difference {rel[worst]:.3g} ({worst})")
    assert rel[worst] < 1e-4, (worst, rel[worst])


def test_dp2_tp2_muon_is_bitwise_the_one_process_update_with_whole_heads_moving_nothing(mesh2d):
    model = _model()
    opts = build_optimizers(model, "muon-split", 1e-2, 0.1)
    named = list(model.named_parameters())
    for k, (_, p) in enumerate(named):
        p.grad = _synthetic(p.shape, k) if p.requires_grad else None
    opts[0].step()
    after = load_file(mesh2d / "after_muon.safetensors")
    muon_names = {n for g in opts[0].param_groups for n, p in named for q in g["params"] if q is p}
    bad = [n for n in muon_names if not torch.equal(after[n], dict(named)[n].detach())]
    assert not bad, bad
    stats = json.loads((mesh2d / "stats.json").read_text())
    for s in stats:
        assert s["sent"] == s["planned_sent"]
        assert s["sent"]["per-head"] == 0 and s["received"]["per-head"] == 0
    ns_one = opts[0].ns_matrices if hasattr(opts[0], "ns_matrices") else None
    total_ns = sum(s["ns_matrices"] for s in stats)
    print(
        f"Muon bytes sent per rank: {[sum(s['sent'].values()) for s in stats]}; Newton-Schulz matrices "
        f"over the mesh {total_ns}; parameter + optimizer bytes per rank {[s['bytes'] for s in stats]}"
    )
    expected = sum(b.heads * len(b.sections) for g in opts[0].param_groups for b in g["blocks"])
    assert total_ns == expected, (total_ns, expected, ns_one)


def test_a_dp2_tp2_checkpoint_resumes_bit_exactly_and_loads_at_one_process(mesh2d, tmp_path):
    assert records(mesh2d / "resumed") == records(mesh2d / "run")
    run = tmp_path / "run"
    shutil.copytree(mesh2d / "run", run, symlinks=True)
    trainer = Trainer(TrainConfig(steps=3), run, resume=True)  # 1 process: the 2-D parts put together
    cfg = trainer.model.config
    q_b = trainer.model.model.layers[0].self_attn.q_b_proj.weight
    assert tuple(q_b.shape) == (cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank)
    assert all(len(st) for o in trainer.optimizers for st in o.state.values())
    trainer.run(progress=False)
    assert [r["step"] for r in records(run)] == [1, 2, 3]


def test_a_20_step_dp2_tp2_run_trains(mesh2d):
    recs = [json.loads(ln) for ln in (mesh2d / "long" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((mesh2d / "long" / "summary.json").read_text())
    assert [r["step"] for r in recs] == list(range(1, 21)) and summary["world"] == 4
    first, last = sum(r["lm_loss"] for r in recs[:3]) / 3, sum(r["lm_loss"] for r in recs[-3:]) / 3
    print(f"dp2 x tp2: lm loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.3 and summary["final_eval_loss"] < summary["init_eval_loss"] - 0.3


def test_dp4_each_rank_holds_a_quarter_of_the_parameter_and_optimizer_bytes(mesh2d):
    model = _model()
    opts = build_optimizers(model, "muon-split", 1e-3, 0.1)
    _objective(model, _ids()).backward()
    for o in opts:
        o.step()
    whole = state_bytes(model, opts)
    per_rank = json.loads((mesh2d / "dp4_bytes.json").read_text())
    print(f"dp=4: parameter + optimizer bytes per rank {per_rank} of {whole}")
    assert all(abs(b / whole - 0.25) < 0.01 for b in per_rank)
