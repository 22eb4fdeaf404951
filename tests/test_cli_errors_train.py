"""`glm5 train` never lies, never writes into a stranger's directory and never publishes NaN (issue 21):
--resume with --steps already reached is refused and leaves summary.json alone, an --out holding other
files, an empty one or one that cannot be made is one line, non-finite float options are refused, a run
that diverges stops before it publishes, one writer per --out, a run killed before its first checkpoint
can be started again, pruning never leaves a half-deleted step, and a full disk is one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from glm5.cli import main
from glm5.infra import fsio
from glm5.train.loop.state import checkpoints, latest_checkpoint, save_checkpoint
from glm5.train.loop.trainer import TrainConfig, Trainer

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
    "--save-every",
    "1",
]


def _train(out, *extra):
    return CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, *extra])


def _one_error(res, code, *words):
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == code, (res.output, repr(res.exception))
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.output
    assert "Traceback" not in res.output


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    """A finished 3-step run (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("train") / "run"
    Trainer(TrainConfig(**dict(SMALL, steps=3)), out).run(progress=False)
    return out


def test_resume_with_steps_already_done_is_refused_and_the_summary_stays_true(run3, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run3, out, symlinks=True)
    summary = (out / "summary.json").read_text()
    metrics = (out / "metrics.jsonl").read_text()
    for steps in ("2", "3"):
        res = _train(out, "--resume", "--steps", steps)
        _one_error(res, 2, "'--steps'", "already done (3)")
    assert (out / "summary.json").read_text() == summary and json.loads(summary)["steps"] == 3
    assert (out / "metrics.jsonl").read_text() == metrics


def test_out_that_is_not_a_run_of_ours_or_empty_or_unmakeable_is_one_line(tmp_path, monkeypatch):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine\n")
    _one_error(_train(foreign, "--steps", "1"), 2, "'--out'", "todo.txt")
    assert sorted(p.name for p in foreign.iterdir()) == ["todo.txt"]  # nothing written into it
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        _one_error(_train("", "--steps", "1"), 2, "'--out'", "empty")
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    (tmp_path / "loop").symlink_to("loop")
    _one_error(_train(tmp_path / "loop", "--steps", "1"), 2, "'--out'")
    _one_error(_train(tmp_path / ("x" * 300), "--steps", "1"), 2, "'--out'", "File name too long")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere: the kernel's refusal, as a user would get it
        real_mkdir = os.mkdir

        def refused(path, *args, **kwargs):
            if str(path).startswith(str(ro)):
                raise PermissionError(13, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", refused)
    _one_error(_train(ro / "run", "--steps", "1"), 2, "'--out'", "Permission denied")


@pytest.mark.parametrize(
    "option, value",
    [
        ("--lr", "inf"),
        ("--lr", "nan"),
        ("--lr", "0"),
        ("--lr", "-1"),
        ("--temperature", "nan"),
        ("--temperature", "inf"),
    ],
)
def test_non_finite_or_non_positive_floats_are_refused(tmp_path, option, value):
    _one_error(_train(tmp_path / "run", "--steps", "1", option, value), 2, f"'{option}'")
    assert not (tmp_path / "run").exists()
    if (option, value) != ("--lr", "0"):  # the library takes lr 0: a frozen-policy control run (test_rl)
        with pytest.raises(ValueError, match=option[2:]):
            TrainConfig(**{option[2:]: float(value)})


def test_a_diverging_run_stops_before_it_publishes_non_finite_parameters(tmp_path):
    out = tmp_path / "run"
    res = _train(out, "--steps", "4", "--lr", "1e30", "--warmup-steps", "0")
    _one_error(res, 1, "diverged", "--lr")
    assert not (out / "summary.json").exists()
    for _, ckpt in checkpoints(out / "checkpoints"):
        for name, t in load_file(ckpt / "model.safetensors").items():
            assert torch.isfinite(t).all(), (ckpt.name, name)


def test_a_second_writer_on_the_same_out_is_refused(run3, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run3, out, symlinks=True)
    metrics = (out / "metrics.jsonl").read_text()
    with fsio.exclusive(out / ".lock"):  # as a train running on it holds it
        _one_error(_train(out, "--resume", "--steps", "4"), 2, "'--out'", f"pid {os.getpid()}")
    assert (out / "metrics.jsonl").read_text() == metrics
    assert _train(out, "--resume", "--steps", "4").exit_code == 0  # released: it continues
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_run_killed_before_its_first_checkpoint_can_be_started_again(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / f".staging-{_dead_pid()}-x1").mkdir(parents=True)  # the save it was in
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 6.0}) + "\n")
    _one_error(_train(out, "--resume", "--steps", "2"), 2, "'--resume'", "without --resume")
    res = _train(out, "--steps", "2")
    assert res.exit_code == 0, res.output
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and latest_checkpoint(out / "checkpoints").name == "step-000002"


class _Killed(BaseException):
    pass


def test_pruning_never_leaves_a_half_deleted_checkpoint_under_its_name(tmp_path, monkeypatch):
    trainer = Trainer(TrainConfig(**dict(SMALL, steps=1)), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, trainer.model, trainer.optimizers, {}, keep=2)
    real = shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):
        if "step-000001" in str(path):  # the pruned checkpoint: one file gone, then the kill
            (path / "model.safetensors").unlink()
            raise _Killed
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_mid_delete)
    with pytest.raises(_Killed):
        save_checkpoint(root, 3, trainer.model, trainer.optimizers, {}, keep=2)
    monkeypatch.undo()
    for _, ckpt in checkpoints(root):  # every step-N there is whole
        assert (ckpt / "model.safetensors").is_file(), ckpt
    assert [s for s, _ in checkpoints(root)] == [2, 3]


def test_a_full_disk_is_one_line_and_loses_nothing(run3, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "run"
    shutil.copytree(run3, out, symlinks=True)
    real = safetensors.torch.save_file

    def full(tensors, path, *args, **kwargs):
        if "step-000004" in str(path):  # what the Rust writer raises on ENOSPC
            raise SafetensorError(
                f'Error while serializing: I/O error: No space left on device (os error 28) at path "{path}"'
            )
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    res = _train(out, "--resume", "--steps", "4")
    _one_error(res, 1, "No space left on device", "step-000004")
    root = out / "checkpoints"
    assert latest_checkpoint(root).name == "step-000003"
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "staging left behind"


def _dead_pid() -> int:
    import subprocess
    import sys

    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )


@pytest.mark.parametrize(
    "extra, hint",
    [
        (["--seq-len", "100000000"], "'--seq-len'"),
        (["--seq-len", "5000"], "max_position_embeddings=4096"),
        (["--stage", "rl", "--prompt-len", "4000", "--response-len", "200"], "'--response-len'"),
    ],
)
def test_sequences_past_the_models_positions_are_refused_before_building(tmp_path, extra, hint):
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "o"), *ARGS, "--steps", "1", *extra])
    _one_error(res, 2, hint)
    assert not (tmp_path / "o").exists()


def test_layout_invariant_with_experts_split_by_tp_is_refused_before_any_rank_starts(tmp_path):
    """The mode has no exact product for experts split on their intermediate dim: one line, exit 2, before
    the launcher (it used to fail inside each rank, behind the launcher's traceback and exit code)."""
    extra = ["--stage", "rl", "--rollout-engine", "policy", "--layout-invariant", "--nproc", "2"]
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "o"), *ARGS, *extra, "--mesh", "tp=2"])
    _one_error(res, 2, "'--mesh'", "ep=N")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["optimizer.safetensors", "rng.safetensors", "optimizer.json"])
def test_resume_from_a_broken_trainer_file_is_one_line_naming_it(run3, tmp_path, name):
    out = tmp_path / "run"
    shutil.copytree(run3, out, symlinks=True)
    f = latest_checkpoint(out / "checkpoints") / "trainer" / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = _train(out, "--resume", "--steps", "4")
    _one_error(res, 2, name)
