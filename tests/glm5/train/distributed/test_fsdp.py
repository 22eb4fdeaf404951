"""`glm5 train` data parallel with FSDP2 (ZeRO-2 / ZeRO-3) on 2 gloo ranks: gradients bitwise equal to a
1-process run over the same micro-batches, per-rank memory halved, a 20-step run that trains, the
--nproc / --mesh / --zero checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.distributed.mesh import Mesh, check_mesh, parse_mesh
from glm5.train.distributed.runtime import Dist, full, state_bytes
from glm5.train.loop.data import ByteCorpus
from glm5.train.loop.dsa import AttentionProbe
from glm5.train.loop.losses import lm_and_mtp
from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.muon.optimizer import build_optimizers
from tests.glm5.train._dist import spawn

BATCH, SEQ = 4, 32


def _model() -> GLM5ForCausalLM:
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="cpu")
    m.init_weights(0)
    return m


def _ids() -> torch.Tensor:
    return ByteCorpus(max_bytes=128 << 10).batch(BATCH, SEQ, seed=0, step=0)


def _objective(model, ids) -> torch.Tensor:
    """The sparse stage's loss: LM + MTP + the indexers' KL (through the probe's hooks)."""
    probe = AttentionProbe(model, stage="sparse")
    losses = lm_and_mtp(model, ids, 1)
    probe.remove()
    return losses.lm + 0.3 * losses.mtp + probe.kl_loss()


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
    # the Trainer on the same process group: 20 steps at ZeRO-2
    cfg = TrainConfig(
        steps=20,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        warmup_steps=2,
        eval_every=10,
        eval_batches=1,
        save_every=20,
        max_bytes=256 << 10,
        deterministic=True,
    )
    Trainer(cfg, f"{out}/run", mesh=Mesh(dp=world), zero=2).run(progress=False)
    # the same run split by the plan instead: tensor parallel, then expert parallel
    Trainer(cfg, f"{out}/tp", mesh=Mesh(tp=world)).run(progress=False)
    Trainer(cfg, f"{out}/ep", mesh=Mesh(ep=world)).run(progress=False)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_fsdp_worker, 2, str(out))
    return out


@pytest.fixture(scope="module")
def micro():
    """The 1-process runs over each rank's micro-batch: (model, loss, gradients)."""
    ids = _ids()
    return [_one_process(ids[r * BATCH // 2 : (r + 1) * BATCH // 2]) for r in range(2)]


def _one_process(ids):
    model = _model()
    loss = _objective(model, ids)
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("zero", [2, 3])
def test_dp2_loss_and_every_gradient_bitwise_equal_to_one_process_over_the_same_micro_batches(
    fsdp_run, micro, zero
):
    got = load_file(fsdp_run / f"zero{zero}.safetensors")
    dist_losses = got.pop("__losses__")
    ids = _ids()
    assert torch.equal(dist_losses, torch.stack([m[1] for m in micro]))
    # FSDP2 on gloo divides each rank's gradient by the world size before the (2-term) sum
    ref = {n: micro[0][2][n] / 2 + micro[1][2][n] / 2 for n in micro[0][2]}
    assert sorted(got) == sorted(ref) and len(ref) == 103  # every parameter the loss reaches (103 of 107)
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


@pytest.mark.parametrize("run", ["run", "tp", "ep"], ids=["dp2", "tp2", "ep2"])
def test_a_20_step_run_trains(fsdp_run, run):
    recs = [json.loads(ln) for ln in (fsdp_run / run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((fsdp_run / run / "summary.json").read_text())
    assert [r["step"] for r in recs] == list(range(1, 21)) and summary["world"] == 2
    first, last = sum(r["lm_loss"] for r in recs[:3]) / 3, sum(r["lm_loss"] for r in recs[-3:]) / 3
    print(
        f"{run}: lm loss {first:.3f} -> {last:.3f}; held-out {summary['init_eval_loss']:.3f} -> "
        f"{summary['final_eval_loss']:.3f}"
    )
    assert last < first - 0.3 and summary["final_eval_loss"] < summary["init_eval_loss"] - 0.3
    assert (fsdp_run / run / "checkpoints" / "latest" / "model").is_dir()


def test_mesh_parsing():
    assert parse_mesh("dp=2") == Mesh(dp=2)
    assert parse_mesh("dp=2, tp=1,ep=1,pp=1") == Mesh(dp=2)
    check_mesh(Mesh(dp=4), 4)
    for text, msg in [
        ("dp=0", "dp: expected an integer >= 1, got 0"),
        ("dp=x", "dp: expected an integer"),
        ("zz=2", "AXIS=N"),
        ("dp=2,dp=2", "given twice"),
        ("", "AXIS=N"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_mesh(text)


@pytest.mark.parametrize(
    "args, hint, msg",
    [
        (["--nproc", "2", "--mesh", "dp=3"], "'--mesh'", "multiply to 3"),
        (["--nproc", "2", "--mesh", "dp=2,tp=0"], "'--mesh'", "tp: expected an integer >= 1, got 0"),
        (["--nproc", "4", "--mesh", "tp=2,ep=2"], "'--mesh'", "expected one axis above 1 or a 2-D mesh"),
        (["--nproc", "4", "--mesh", "dp=2,pp=2"], "'--mesh'", "expected one axis above 1 or a 2-D mesh"),
        (["--nproc", "2", "--mesh", "pp"], "'--mesh'", "expected AXIS=N"),
        (["--nproc", "3", "--mesh", "ep=3"], "'--mesh'", "n_routed_experts: 8 does not split over 3 ranks"),
        (
            ["--nproc", "4", "--mesh", "dp=4,ep=2"],
            "'--mesh'",
            "ep=2 with dp=4: experts across the data-parallel",
        ),
        (
            ["--nproc", "4", "--mesh", "dp=2,ep=2"],
            "'--mesh'",
            "ep borrows the dp ranks), expected --nproc (4)",
        ),
        (["--nproc", "2", "--batch-size", "3"], "'--batch-size'", "must divide by dp (2), got 3"),
        (["--nproc", "0"], "'--nproc'", "0"),
    ],
)
def test_bad_parallel_options_are_one_line_exit_2_before_anything_is_written(tmp_path, args, hint, msg):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--out", str(out), "--steps", "1", *args])
    assert res.exit_code == 2, res.output
    error = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(error) == 1 and hint in error[0] and msg in error[0], res.output
    assert not out.exists()


def test_a_tp2_run_follows_the_dp2_run_and_its_checkpoint_resumes_at_one_rank(fsdp_run, tmp_path):
    def records(run):
        return [json.loads(ln) for ln in (fsdp_run / run / "metrics.jsonl").read_text().splitlines()]

    tp, dp = records("tp")[:4], records("run")[:4]
    for a, b in zip(tp, dp, strict=True):
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (a["step"], key, a[key], b[key])
    run = tmp_path / "tp"
    shutil.copytree(fsdp_run / "tp", run, symlinks=True)
    trainer = Trainer(TrainConfig(steps=21), run, resume=True)  # 1 process: the tp slices put back together
    q_b = trainer.model.model.layers[0].self_attn.q_b_proj.weight
    assert tuple(q_b.shape) == (
        trainer.model.config.num_attention_heads * trainer.model.config.qk_head_dim,
        trainer.model.config.q_lora_rank,
    )
    assert all(len(st) for o in trainer.optimizers for st in o.state.values())
    trainer.run(progress=False)
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 22))


def test_resuming_a_one_process_run_on_two_is_refused_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    runner = CliRunner()
    small = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "1", "--quiet", "--no-rollout-check"]
    res = runner.invoke(main, ["train", "--out", str(out), "--steps", "1", *small])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["train", "--out", str(out), "--steps", "2", "--resume", "--nproc", "2"])
    assert res.exit_code == 2, res.output
    error = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(error) == 1 and "'--resume'" in error[0] and "written by a 1-process run" in error[0]
