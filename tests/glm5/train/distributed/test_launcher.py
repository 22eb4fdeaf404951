"""`glm5 train --nproc N` refuses in its launcher what the single-process command refuses, once, at once,
with exit 2, before any rank starts; options that do nothing in the given configuration are refused naming
what they need; one owner per run (a rank of an earlier run keeps a new writer out); Ctrl-C and a dead
rank are one line with the last checkpoint and the resume command (issue 33). The launcher-kill test is
in test_dist_checkpoint.py (it compares with that module's uninterrupted run)."""

from __future__ import annotations

import os
import shutil
import signal
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from glm5.cli import main
from glm5.infra import fsio
from glm5.train import ownership
from glm5.train.distributed import runtime as distributed
from glm5.train.loop.state import latest_checkpoint
from glm5.train.loop.trainer import TrainConfig, Trainer

SMALL = dict(batch_size=2, seq_len=16, eval_every=2, eval_batches=1, save_every=1, max_bytes=64 << 10)
ARGS = ["--quiet", "--no-rollout-check", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2"]


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    """A check that lets the command through would start ranks: fail the test instead."""

    def launch(argv, nproc):
        raise AssertionError(f"ranks started for {argv}")

    monkeypatch.setattr(distributed, "launch", launch)


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    out = tmp_path_factory.mktemp("launcher") / "run"
    Trainer(TrainConfig(**dict(SMALL, steps=2)), out).run(progress=False)
    return out


def _one_error(res, *words):
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2, (res.output, repr(res.exception))
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--steps", "3"], ("'--out'", "already holds a run", "--resume")),
        (["--steps", "2", "--resume"], ("'--steps'", "must exceed the steps already done (2)")),
        (["--steps", "3", "--resume"], ("'--resume'", "written by a 1-process run")),
    ],
)
def test_what_a_rank_would_refuse_is_refused_by_the_launcher(run2, extra, words):
    res = CliRunner().invoke(main, ["train", "--out", str(run2), "--nproc", "2", *ARGS, *extra])
    _one_error(res, *words)


def test_nothing_to_resume_and_rl_fp8_on_two_ranks_are_refused_by_the_launcher(tmp_path):
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "a"), "--nproc", "2", "--resume", *ARGS])
    _one_error(res, "'--resume'", "no checkpoint to resume")
    extra = ["--stage", "rl", "--rollout-precision", "fp8", "--steps", "1"]
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "b"), "--nproc", "2", *ARGS, *extra])
    _one_error(res, "rollout_precision", "several processes")


@pytest.mark.parametrize(
    "extra, hint, needs",
    [
        (["--push-every", "2"], "'--push-every'", "--rollout-engine policy|vllm"),
        (["--max-staleness", "2"], "'--max-staleness'", "--rollout-engine policy|vllm"),
        (["--rollout-engine", "policy"], "'--rollout-engine'", "--stage rl"),
        (["--stage", "rl", "--rollout-engine", "policy", "--engine-tp", "2"], "'--engine-tp'", "vllm"),
        (["--zero", "2"], "'--zero'", "dp > 1"),
        (["--nproc", "2", "--mesh", "tp=2", "--zero", "2"], "'--zero'", "dp > 1"),
    ],
)
def test_an_option_that_does_nothing_is_refused_naming_what_it_needs(tmp_path, extra, hint, needs):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--out", str(out), "--steps", "1", *ARGS, *extra])
    _one_error(res, hint, "does nothing", needs)
    assert not out.exists()


def test_ctrl_c_is_one_line_with_the_last_checkpoint_and_the_resume_command_exit_130(
    run2, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    shutil.copytree(run2, out, symlinks=True)

    def interrupted(self, progress=True):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "run", interrupted)
    res = CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, "--steps", "3", "--resume"])
    assert res.exit_code == 130, (res.output, repr(res.exception))
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in res.output and "Aborted" not in res.output, res.output
    assert str(out / "checkpoints" / "step-000002") in errors[0] and "--resume" in errors[0], errors[0]
    assert not (out / ".lock").exists()


def test_a_rank_of_an_earlier_run_still_alive_keeps_a_new_writer_out(run2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run2, out, symlinks=True)
    with fsio.exclusive(out / f"{ownership.RANK_LOCK}1"):  # an orphaned rank 1 of a killed launcher
        res = CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, "--steps", "3", "--resume"])
        _one_error(res, "'--out'", "rank 1 of an earlier run", f"pid {os.getpid()}")
    assert latest_checkpoint(out / "checkpoints").name == "step-000002"  # nothing ran
    (out / f"{ownership.RANK_LOCK}1").write_text("12345\n")  # the lock file a killed rank left: no owner
    res = CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, "--steps", "3", "--resume"])
    assert res.exit_code == 0, res.output
    assert not list(out.glob(".lock*"))


def _failure(pid, exitcode, timestamp=0):
    return SimpleNamespace(
        pid=pid,
        exitcode=exitcode,
        timestamp=timestamp,
        signal_name=lambda: signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>",
    )


def test_the_launcher_names_the_rank_that_died_and_its_signal_with_a_stable_code(run2):
    sigterm, sigkill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    # the agent's SIGTERM to the survivor counts after the rank that died first
    line, code = ownership.rank_failure({0: _failure(10, sigterm), 1: _failure(11, sigkill, 5)}, run2)
    assert code == ownership.RANK_DIED and line.startswith("rank 1 (pid 11) died of SIGKILL"), line
    assert "step-000002" in line and "--resume" in line
    line, code = ownership.rank_failure(
        {0: _failure(10, ownership.PEER_LOST), 1: _failure(11, sigkill)}, run2
    )
    assert code == ownership.RANK_DIED and line.startswith("rank 1 (pid 11) died of SIGKILL"), line
    # a rank that exited with a code printed its own line: the launcher adds none and exits with it
    assert ownership.rank_failure({1: _failure(11, 2)}, run2) == (None, 2)
    line, code = ownership.rank_failure({0: _failure(10, ownership.PEER_LOST)}, run2)
    assert code == ownership.RANK_DIED and "rank 0 lost contact" in line


def test_without_matplotlib_the_plot_message_names_the_extra(tmp_path, monkeypatch):
    from glm5.train import plots

    def missing(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(plots, "plot_metrics", missing)
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "run"), *ARGS, "--steps", "1"])
    assert res.exit_code == 0, res.output
    assert "pip install 'glm5-backends[train]'" in res.output, res.output


def test_a_run_killed_before_latest_pointed_at_its_first_checkpoint_resumes_from_it(run2, tmp_path):
    """A kill between the publish (one rename: the checkpoint is complete) and `latest`: the newest step."""
    out = tmp_path / "run"
    shutil.copytree(run2, out, symlinks=True)
    (out / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(out / "checkpoints").name == "step-000002"
    res = CliRunner().invoke(main, ["train", "--out", str(out), *ARGS, "--steps", "3", "--resume"])
    assert res.exit_code == 0, res.output
    assert latest_checkpoint(out / "checkpoints").name == "step-000003"
