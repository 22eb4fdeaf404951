"""The RL stage is given its pieces (glm5/train/rl/stage.py RLContext) instead of reaching into the trainer: a
step run from a context of the pieces alone matches the trainer's own step, and rl.py / rl_async.py name no
Trainer."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.rl import asynchronous as rl_async
from glm5.train.rl import stage as rl
from glm5.train.rl.stage import RLContext, rl_step

RL = dict(
    stage="rl",
    steps=1,
    batch_size=2,
    group_size=4,
    prompt_len=8,
    response_len=8,
    seq_len=16,
    warmup_steps=0,
    eval_every=1000,
    eval_batches=1,
    save_every=1000,
    max_bytes=64 << 10,
    deterministic=True,
)


def test_a_step_from_the_pieces_alone_matches_the_trainers(tmp_path):
    a = Trainer(TrainConfig(**RL), tmp_path / "a")
    b = Trainer(TrainConfig(**RL), tmp_path / "b")
    pieces = {f.name: getattr(b.rl, f.name) for f in dataclasses.fields(RLContext) if f.name != "session"}
    ctx = RLContext(**pieces)  # a context built from its fields, no trainer in reach
    ra, rb = a.train_step(0), rl_step(ctx, 0)
    for rec in (ra, rb):
        rec.pop("step_s")
    assert ra == rb


def test_the_context_is_frozen(tmp_path):
    trainer = Trainer(TrainConfig(**RL), tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.rl.model = None


@pytest.mark.parametrize("module", [rl, rl_async], ids=lambda m: m.__name__)
def test_the_rl_modules_name_no_trainer(module):
    tree = ast.parse(Path(module.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {"trainer", "Trainer"} & (names | imported)
