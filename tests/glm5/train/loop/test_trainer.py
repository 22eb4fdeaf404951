import importlib.util
import json
import os

import pytest
import torch
from click.testing import CliRunner

from glm5.cli import main
from glm5.core.model import GLM5ForCausalLM
from glm5.train.loop.state import latest_checkpoint, save_checkpoint
from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.glm5.train._runs import records

# batch 2 x 32 tokens against index_topk 16: sparse attention really is sparse
SMALL = dict(batch_size=2, seq_len=32, eval_every=2, eval_batches=1, save_every=2, max_bytes=256 << 10)


def _run(out, steps, resume=False, **kw):
    cfg = TrainConfig(**dict(SMALL, steps=steps, deterministic=True, **kw))
    return Trainer(cfg, out, resume=resume).run(progress=False)


def test_deterministic_runs_match_bitwise_and_resume_is_exact(tmp_path):
    _run(tmp_path / "a", 4)
    _run(tmp_path / "b", 4)
    _run(tmp_path / "c", 2)
    _run(tmp_path / "c", 4, resume=True)
    a, b, c = (records(tmp_path / x) for x in "abc")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert a == b  # bitwise: floats compared exactly
    assert a == c
    ck = latest_checkpoint(tmp_path / "c" / "checkpoints")
    assert ck.name == "step-000004"
    sa = GLM5ForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "a" / "checkpoints")).state_dict()
    sc = GLM5ForCausalLM.from_pretrained(ck).state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    trainer = Trainer(TrainConfig(**dict(SMALL, steps=1)), tmp_path)
    root = tmp_path / "checkpoints"
    first = save_checkpoint(root, 1, trainer.model, trainer.optimizers, {})
    files = {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()}

    class Broken(torch.optim.SGD):
        def state_dict(self):
            raise OSError("disk full")

    bad = Broken(trainer.params, lr=0.1)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 2, trainer.model, [bad], {})
    assert latest_checkpoint(root) == first
    assert {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()} == files
    assert sorted(os.listdir(root)) == ["latest", "step-000001"]  # no staging or partial step left


def test_warmup_stage_trains_only_the_indexers(tmp_path):
    cfg = TrainConfig(**dict(SMALL, steps=2, stage="warmup"))
    trainer = Trainer(cfg, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.run(progress=False)
    for n, p in trainer.model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (".indexer." in n), n  # the MTP layer's indexer learns too (MTP runs)
    rec = records(tmp_path)[-1]
    assert rec["kl_loss"] is not None and rec["loss"] == rec["kl_loss"]


def test_cli_writes_metrics_plot_checkpoint_and_rollout_check(tmp_path):
    out = tmp_path / "run"
    # the reference: its batch_invariant() mode makes a decode-time row bitwise the training row; the cpu
    # backend (the CLI default) batches attention per query block, so it agrees to ~1e-6, not bitwise
    args = ["train", "--config", "tiny", "--steps", "2", "--deterministic", "--out", str(out), "--quiet"]
    args += ["--backend", "reference"]
    args += ["--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--save-every", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2] and all("loss" in r for r in recs)
    if importlib.util.find_spec("matplotlib"):  # the `train` extra
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "loss.png not written" in res.output and not (out / "loss.png").exists()
    ck = latest_checkpoint(out / "checkpoints")
    assert (ck / "config.json").is_file() and (ck / "model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout"]["bitwise_equal"] and summary["rollout"]["ratio_max"] == 1.0


def test_bad_options():
    with pytest.raises(ValueError, match="stage"):
        TrainConfig(stage="dense")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
