"""Sharded checkpoints of `glm5 train --nproc N` (torch.distributed.checkpoint in safetensors): a 2-rank
run stopped after a save resumes bit-exactly; its checkpoint loads at 1 rank and at 4 (resharded) and
continues the same run; export-hf / import-hf round trip; refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from glm5.cli import main
from glm5.core.model import GLM5ForCausalLM
from glm5.train.distributed import checkpoint as dist_state
from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.glm5.train._runs import TRAIN_ARGS, records, train_cli


def _shards(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    files = [*(ckpt / "model").glob("*.safetensors"), *(ckpt / "trainer" / "optim").glob("*.safetensors")]
    for f in sorted(files):
        out.update({f"{f.parent.name}/{f.name}/{k}": v for k, v in load_file(f).items()})
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """4 steps on 2 ranks, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("dist") / "straight"
    train_cli(out, "--nproc", "2", "--steps", "4")
    return out


def test_a_two_rank_run_stopped_after_a_save_resumes_bit_exactly(straight, tmp_path):
    out = tmp_path / "resumed"  # the run as it was when stopped right after its step-2 save
    shutil.copytree(straight, out, symlinks=True)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to("step-000002")
    train_cli(out, "--nproc", "2", "--steps", "4", "--resume")
    assert records(out) == records(straight)  # every loss, norm and eval bitwise
    a, b = _shards(straight / "checkpoints" / "latest"), _shards(out / "checkpoints" / "latest")
    assert a.keys() == b.keys() and len(a) > 100
    assert all(torch.equal(a[k], b[k]) for k in a)  # parameters and optimizer state
    saved = json.loads((out / "checkpoints" / "latest" / "trainer" / "trainer_state.json").read_text())
    assert saved["step"] == 4 and saved["world"] == 2


def _full_optimizer_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The optimizer tensors of a sharded checkpoint, whole (read by one process)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    md = HuggingFaceStorageReader(str(ckpt / "trainer" / "optim")).read_metadata().state_dict_metadata
    state = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in md.items()}
    dist_state._load(state, ckpt / "trainer" / "optim")
    return state


def test_the_checkpoint_loads_at_one_rank_and_at_four_and_both_continue_the_run(straight, tmp_path):
    one, four = tmp_path / "one", tmp_path / "four"
    shutil.copytree(straight, one, symlinks=True)
    shutil.copytree(straight, four, symlinks=True)
    ckpt = straight / "checkpoints" / "latest"
    trainer = Trainer(TrainConfig(steps=6), one, resume=True)  # 1 process, no process group
    want = dist_state.model_from(ckpt)
    got = dict(trainer.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in want.named_parameters())
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizers)
    saved = _full_optimizer_state(ckpt)
    loaded = {
        f"{fqn}:{k}": v
        for fqn, st in osd["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    trainer.run(progress=False)
    train_cli(four, "--nproc", "4", "--steps", "6", "--resume")
    r1, r4 = records(one)[4:], records(four)[4:]
    assert [r["step"] for r in r1] == [r["step"] for r in r4] == [5, 6]
    for a, b in zip(r1, r4, strict=True):
        for key in ("loss", "lm_loss", "grad_norm", "eval_loss"):
            if a.get(key) is not None:
                assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (key, a[key], b[key])


def test_export_hf_and_import_hf_round_trip_and_refuse_to_overwrite(straight, tmp_path):
    ckpt = straight / "checkpoints" / "latest"
    runner = CliRunner()
    hf, back = tmp_path / "hf", tmp_path / "back"
    res = runner.invoke(main, ["checkpoint", "export-hf", str(ckpt), str(hf)])
    assert res.exit_code == 0, res.output
    want = dict(dist_state.model_from(ckpt).named_parameters())
    got = GLM5ForCausalLM.from_pretrained(hf)
    assert all(torch.equal(want[n], p) for n, p in got.named_parameters())
    res = runner.invoke(main, ["checkpoint", "import-hf", str(hf), str(back)])
    assert res.exit_code == 0, res.output
    again = dict(dist_state.model_from(back).named_parameters())
    assert all(torch.equal(want[n], again[n]) for n in want)
    before = sorted(p.name for p in hf.iterdir())
    res = runner.invoke(main, ["checkpoint", "export-hf", str(ckpt), str(hf)])
    assert res.exit_code == 2 and "'OUT'" in res.output and "already exists" in res.output
    assert sorted(p.name for p in hf.iterdir()) == before
    res = runner.invoke(main, ["checkpoint", "export-hf", str(hf), str(tmp_path / "x")])
    assert res.exit_code == 2 and "not a sharded" in res.output
    res = runner.invoke(main, ["checkpoint", "import-hf", str(ckpt), str(tmp_path / "y")])
    assert res.exit_code == 2 and "not a Hugging Face" in res.output
    quantized = tmp_path / "quantized"  # a config that says compressed-tensors is enough to refuse it
    shutil.copytree(hf, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    res = runner.invoke(main, ["checkpoint", "import-hf", str(quantized), str(tmp_path / "z")])
    assert res.exit_code == 2 and "is a quantized checkpoint" in res.output, res.output
    assert not any((tmp_path / n).exists() for n in "xyz")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; torchrun's workers may sit in sessions of their own)."""
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for a reaper that may be slow)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through Linux /proc")
def test_a_two_rank_run_whose_launcher_is_killed_stops_and_resumes_bit_exactly(straight, tmp_path):
    """SIGKILL to the launcher alone (an OOM kill, a `kill -9`) once the step-2 checkpoint is published,
    while the run goes on to step 3: its ranks (in sessions of their own) are gone within seconds, and the
    resume (the dead run's locks, staging and metrics past the checkpoint recovered) ends bitwise where the
    uninterrupted run ended."""
    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "glm5.cli", "train", "--nproc", "2", "--out", str(out), *TRAIN_ARGS]
    proc = subprocess.Popen(
        [*cmd, "--steps", "4"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "step-000002").is_dir():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no step-2 checkpoint within 240 s"
        time.sleep(0.01)
    ranks = _descendants(proc.pid)
    assert len(ranks) >= 2, ranks
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(_running(r) for r in ranks):
        assert time.monotonic() < deadline, f"ranks still running 10 s after the launcher died: {ranks}"
        time.sleep(0.05)
    assert not (out / "checkpoints" / "step-000004").exists(), "the run saved step 4 before it was killed"
    train_cli(out, "--nproc", "2", "--steps", "4", "--resume")
    assert records(out) == records(straight)
    a, b = _shards(straight / "checkpoints" / "latest"), _shards(out / "checkpoints" / "latest")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
