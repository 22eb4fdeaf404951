"""A run directory is never overwritten nor confused (issue 13 items 1, 8, 15, 16): a second run into the
same --out is refused, retention never deletes the checkpoint just written, a torn metrics line does not
break --resume, `checkpoints/latest` is a path, files are fsynced and readable by other users."""

from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner

from glm5.cli import main
from glm5.core.model import GLM5ForCausalLM
from glm5.train.loop.state import LATEST, checkpoints, latest_checkpoint, save_checkpoint
from glm5.train.loop.trainer import NothingToResume, RunExists, TrainConfig, Trainer

SMALL = dict(batch_size=1, seq_len=16, eval_every=2, eval_batches=1, save_every=1, max_bytes=64 << 10)
ARGS = [
    "--config",
    "tiny",
    "--quiet",
    "--no-rollout-check",
    "--batch-size",
    "1",
    "--seq-len",
    "16",
    "--eval-every",
    "2",
]


def _train(out, *extra):
    return CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, *extra])


def test_second_run_into_the_same_out_is_refused_and_loses_nothing(tmp_path):
    out = tmp_path / "run"
    Trainer(TrainConfig(**dict(SMALL, steps=3)), out).run(progress=False)
    before = [p.name for _, p in checkpoints(out / "checkpoints")]
    metrics = (out / "metrics.jsonl").read_text()
    res = _train(out, "--steps", "2", "--save-every", "1")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--out" in res.output and "--resume" in res.output
    assert [p.name for _, p in checkpoints(out / "checkpoints")] == before
    assert (out / "metrics.jsonl").read_text() == metrics
    assert latest_checkpoint(out / "checkpoints").name == "step-000003"
    with pytest.raises(RunExists):
        Trainer(TrainConfig(**dict(SMALL, steps=1)), out)


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    trainer = Trainer(TrainConfig(**dict(SMALL, steps=1)), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    for step in (6, 2):  # a later step from another timeline is left alone, the new one is kept
        save_checkpoint(root, step, trainer.model, trainer.optimizers, {}, keep=1)
    assert [s for s, _ in checkpoints(root)] == [2, 6]
    assert latest_checkpoint(root).name == "step-000002"
    for step in (3, 4):
        save_checkpoint(root, step, trainer.model, trainer.optimizers, {}, keep=2)
    assert [s for s, _ in checkpoints(root)] == [3, 4, 6]


def test_resume_survives_a_torn_metrics_line(tmp_path):
    out = tmp_path / "run"
    Trainer(TrainConfig(**dict(SMALL, steps=2, deterministic=True)), out).run(progress=False)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # a kill in the middle of a write
    Trainer(TrainConfig(**dict(SMALL, steps=3, deterministic=True)), out, resume=True).run(progress=False)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_latest_is_a_path_and_old_text_pointer_still_reads(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--steps", "2", "--save-every", "1").exit_code == 0
    latest = out / "checkpoints" / LATEST
    assert latest.is_symlink() and os.readlink(latest) == "step-000002"
    GLM5ForCausalLM.from_pretrained(latest, backend="reference")
    res = CliRunner().invoke(
        main, ["generate", "--model", str(latest), "--max-new-tokens", "2", "--prompt-ids", "1,2,3"]
    )
    assert res.exit_code == 0, res.output
    latest.unlink()
    latest.write_text("step-000001\n")  # what earlier versions wrote
    assert latest_checkpoint(out / "checkpoints").name == "step-000001"


def test_checkpoint_files_are_fsynced_and_shared(tmp_path, monkeypatch):
    trainer = Trainer(TrainConfig(**dict(SMALL, steps=1)), tmp_path / "run")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    final = save_checkpoint(tmp_path / "run" / "checkpoints", 1, trainer.model, trainer.optimizers, {})
    names = {os.path.basename(p) for p in synced}
    for f in (
        "model.safetensors",
        "config.json",
        "optimizer.safetensors",
        "rng.safetensors",
        "trainer_state.json",
        "checkpoints",
    ):
        assert f in names, f
    mask = os.umask(0)
    os.umask(mask)
    for p in [final, *final.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_resume_with_nothing_and_bad_numbers_are_one_line_errors(tmp_path):
    with pytest.raises(NothingToResume):
        Trainer(TrainConfig(**dict(SMALL, steps=1)), tmp_path / "empty", resume=True)
    for extra, word in (
        (["--resume"], "--resume"),
        (["--save-every", "0"], "--save-every"),
        (["--config", "nope"], "--config"),
        (["--steps", "0"], "--steps"),
        (["--backend", "nope"], "--backend"),
        (["--model", str(tmp_path)], "--model"),
    ):
        res = _train(tmp_path / "new", *extra)
        assert res.exit_code == 2, (extra, res.output)
        assert "Traceback" not in res.output and word in res.output, res.output


def test_resume_refuses_an_option_that_differs_from_the_saved_run(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--steps", "2", "--save-every", "1").exit_code == 0
    res = _train(out, "--steps", "3", "--resume", "--lr", "0.01")
    err = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2 and len(err) == 1, res.output
    assert "'--lr'" in err[0] and "0.003" in err[0] and "only --steps" in err[0], res.output
    assert latest_checkpoint(out / "checkpoints").name == "step-000002"  # nothing ran
    res = _train(out, "--steps", "3", "--resume", "--seq-len", "16")  # the saved value: accepted
    assert res.exit_code == 0, res.output
    assert latest_checkpoint(out / "checkpoints").name == "step-000003"
