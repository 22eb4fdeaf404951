"""`glm5 train --nproc 2 --mesh pp=2` (glm5/train/distributed/pipeline/run.py): a run stopped after a save
resumes bit-exactly, its checkpoint loads at 1 process, each rank holds about half the model; with one
micro-batch a pp run is the 1-process run bit for bit; `--activations` changes nothing in the numbers;
refusals in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from glm5.cli import main
from glm5.cli_args import MODEL_DEFAULT_BACKEND
from glm5.train.distributed import checkpoint as dist_state
from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.glm5.train._runs import TRAIN_ARGS, records, train_cli

PP = ["--nproc", "2", "--mesh", "pp=2"]


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted([*ckpt.rglob("*.safetensors")]):
        if not f.name.startswith("rng-"):
            out.update({f"{f.relative_to(ckpt)}/{k}": v for k, v in load_file(f).items()})
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """4 steps of interleaved 1F1B (4 stages on 2 ranks, the MTP layer on its own), 2 micro-batches,
    decoder layers recomputed in the backward, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("pp") / "straight"
    train_cli(
        out,
        *PP,
        "--pp-schedule",
        "interleaved-1f1b",
        "--mtp-stage",
        "own",
        "--microbatches",
        "2",
        "--activations",
        "recompute",
        "--steps",
        "4",
    )
    return out


def test_a_pp_run_stopped_after_a_save_resumes_bit_exactly(straight, tmp_path):
    out = tmp_path / "resumed"  # the run as it was when stopped right after its step-2 save
    shutil.copytree(straight, out, symlinks=True)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to("step-000002")
    train_cli(out, *PP, "--steps", "4", "--resume")  # schedule, placement, micro-batches: the saved ones
    assert records(out) == records(straight)  # every loss, norm, logit, violation, eval: bitwise
    a, b = _tensors(straight / "checkpoints" / "latest"), _tensors(out / "checkpoints" / "latest")
    assert a.keys() == b.keys() and len(a) > 100
    assert all(torch.equal(a[k], b[k]) for k in a)  # parameters and optimizer state


def test_each_rank_holds_its_stages_only(straight):
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    whole = GLM5ForCausalLM(GLM5Config.from_preset("tiny"))
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    rec = records(straight)[-1]
    per_rank = rec["param_bytes"]
    print(f"\nparameter bytes per rank at pp=2: {per_rank} of {total} (1 process)")
    assert sum(per_rank) == total  # every parameter on exactly one rank
    assert max(per_rank) <= 0.6 * total
    assert max(rec["state_bytes"]) <= 0.6 * sum(rec["state_bytes"])


def test_the_pp_checkpoint_loads_at_one_process(straight, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(straight, one, symlinks=True)
    ckpt = straight / "checkpoints" / "latest"
    trainer = Trainer(TrainConfig(steps=5), one, resume=True)  # 1 process, no process group
    want = dist_state.model_from(ckpt)
    got = dict(trainer.model.named_parameters())
    assert got.keys() == dict(want.named_parameters()).keys()
    assert all(torch.equal(got[n], p) for n, p in want.named_parameters())
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizers)
    saved = _tensors(ckpt)
    optim = {k.rsplit("/", 1)[1]: v for k, v in saved.items() if k.startswith("trainer/")}
    loaded = {
        f"{fqn}:{k}": v
        for fqn, st in osd["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    assert optim.keys() == loaded.keys() and all(torch.equal(optim[k], loaded[k]) for k in optim)
    # the pipeline's held-out loss is the whole model's
    assert trainer.evaluate() == records(straight)[-1]["eval_loss"]


def test_one_micro_batch_through_the_pipeline_is_the_one_process_run(tmp_path):
    """GPipe, MTP with the last stage: losses, the global gradient norm, the largest logit over both
    ranks, the expert violation over every router, the held-out loss and the weights: bitwise."""
    train_cli(tmp_path / "pp", *PP, "--pp-schedule", "gpipe", "--microbatches", "1", "--steps", "2")
    res = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "one"), *TRAIN_ARGS, "--steps", "2"])
    assert res.exit_code == 0, res.output
    pp, one = records(tmp_path / "pp"), records(tmp_path / "one")
    assert [{k: v for k, v in r.items() if not k.endswith("_bytes")} for r in pp] == one
    whole = dist_state.model_from(tmp_path / "pp" / "checkpoints" / "latest")
    from glm5.core.model import GLM5ForCausalLM

    ref = GLM5ForCausalLM.from_pretrained(tmp_path / "one" / "checkpoints" / "latest")
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), ref.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_activations_option_changes_no_number_of_a_one_process_run(tmp_path, mode):
    plain = tmp_path / "none"
    res = CliRunner().invoke(
        main, ["train", "--out", str(plain), *TRAIN_ARGS, "--batch-size", "2", "--steps", "2"]
    )
    assert res.exit_code == 0, res.output
    cfg = TrainConfig(
        steps=2,
        batch_size=2,
        seq_len=32,
        eval_every=2,
        save_every=2,
        activations=mode,
        backend=MODEL_DEFAULT_BACKEND,
        threads=1,
    )
    trainer = Trainer(cfg, tmp_path / mode)
    trainer.run(progress=False)
    assert records(plain) == records(tmp_path / mode)
    a, b = _tensors(plain / "checkpoints" / "latest"), _tensors(tmp_path / mode / "checkpoints" / "latest")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    stats = trainer.model.model.layers[0].activations  # the option reached every layer
    assert stats.calls == 2 and (stats.recomputes if mode == "recompute" else stats.offloaded_tensors) > 0


def test_the_activations_option_reaches_a_distributed_run(straight):
    saved = json.loads((straight / "checkpoints" / "latest" / "trainer" / "trainer_state.json").read_text())
    assert saved["config"]["activations"] == "recompute"
    assert saved["config"]["pp_schedule"] == "interleaved-1f1b" and saved["config"]["mtp_stage"] == "own"


@pytest.mark.parametrize(
    "args, hint, msg",
    [
        (["--pp-schedule", "gpipe"], "'--pp-schedule'", "only with --mesh pp=N"),
        ([*PP, "--microbatches", "3"], "'--microbatches'", "expected a divisor of --batch-size (4), got 3"),
        ([*PP, "--microbatches", "1"], "'--microbatches'", "1f1b needs at least one micro-batch per stage"),
        (["--nproc", "8", "--mesh", "pp=8", "--batch-size", "8"], "'--mesh'", "stages: expected 1..4"),
        ([*PP, "--stage", "rl"], "'--stage'", "rl with pp > 1"),
    ],
)
def test_bad_pipeline_options_are_one_line_exit_2_before_anything_starts(tmp_path, args, hint, msg):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--out", str(out), "--steps", "1", *TRAIN_ARGS, *args])
    assert res.exit_code == 2, res.output
    error = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(error) == 1 and hint in error[0] and msg in error[0], res.output
    assert not out.exists()
