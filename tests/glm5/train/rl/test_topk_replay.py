"""Indexer top-k record / replay (glm5/train/rl/topk_replay.py) with the in-process engine: the engine's
record is the top-k of the queries that produced the sampled tokens (on-policy in the layout-invariant mode
the training forward selects exactly those sets), replay makes the training forward's top-k the recorded sets
bitwise where an engine with other indexer weights selects otherwise, the async loop records the per-layer
overlap figure, and the flags are refused without a rollout engine. vLLM's record:
tests/vllm/test_topk_record.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.rl import asynchronous as rl_async
from glm5.train.rl.engines.local import PolicyEngine, checkpoint_tensors
from glm5.train.rl.rollout import batch_invariant
from glm5.train.rl.topk_replay import RolloutTopk, bytes_per_token, overlap_shares

P, N = 24, 6  # more keys than the tiny preset's index_topk (16): the indexer really chooses


def _setup(perturb: float):
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, backend="reference")
    engine_state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    for name, t in engine_state.items():  # the engine's indexers score differently
        if ".indexer.wq_b." in name:
            t += perturb * t.abs().mean() * torch.randn(t.shape, generator=g)
    engine = PolicyEngine(
        cfg,
        "reference",
        checkpoint_tensors(engine_state, cfg.tie_word_embeddings),
        invariant=True,
        record_topk=True,
    )
    prompts = torch.randint(0, 256, (3, P), generator=torch.Generator().manual_seed(0))
    return cfg, model, prompts, engine.generate(prompts, N, temperature=1.0, seed=1)


def _train_forward(model, prompts, gen, replay: bool):
    """The training forward under the hooks -> (the indexer layers' top-k at the generated tokens'
    queries [B, N, layers, k], the figures)."""
    tk = RolloutTopk(prompts, gen.responses, gen.topk, replay)
    tk.measuring = True
    with torch.no_grad(), batch_invariant(model), tk.hooks(model):
        out = model(torch.cat([prompts, gen.responses], 1)[:, :-1], return_topk=True)
    full = [i for i, t in enumerate(model.config.indexer_types) if t == "full"]
    b, k = prompts.shape[0], model.config.index_topk
    used = torch.stack([out.topk[i].view(b, -1, k)[:, P - 1 :] for i in full], 2)
    return used, tk.figures()


def test_the_record_is_what_the_training_forward_selects_on_policy():
    cfg, model, prompts, gen = _setup(perturb=0.0)
    assert gen.topk.shape == (3, N, cfg.indexer_types.count("full"), cfg.index_topk)
    assert gen.topk.dtype == torch.int32 and int(gen.topk.min()) >= 0  # > index_topk causal keys
    used, fig = _train_forward(model, prompts, gen, replay=False)
    assert torch.equal(used, gen.topk)  # rows aligned: the decode step's query is the training row's
    assert fig["topk_overlap"] == 1.0 and fig["topk_overlap_layers"] == [1.0] * used.shape[2]


def test_replay_makes_the_training_forward_use_the_recorded_sets():
    _, model, prompts, gen = _setup(perturb=0.5)
    own, fig_own = _train_forward(model, prompts, gen, replay=False)
    assert not torch.equal(own, gen.topk)  # the engine selected other keys: replay has work to do
    assert fig_own["topk_overlap"] < 1 and fig_own["topk_indexer_overlap"] is None
    used, fig = _train_forward(model, prompts, gen, replay=True)
    assert torch.equal(used, gen.topk)
    assert fig["topk_overlap"] == 1.0 and fig["topk_overlap_layers"] == [1.0] * used.shape[2]
    # the trainer's own indexers still choose otherwise (from layer 1 on, over replayed hidden states)
    assert fig["topk_indexer_overlap"] < 1


def test_overlap_share_counts_the_training_set():
    rollout = torch.tensor([[3, 1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    train = torch.tensor([[1, 2, 3, -1], [3, 2, 1, 0]], dtype=torch.int32)
    assert overlap_shares(rollout, train).tolist() == [2 / 3, 1.0]


def test_memory_cost_per_generated_token():
    assert bytes_per_token(GLM5Config.from_preset("glm5-744b")) == 78 * 2048 * 4  # 624 KiB


LOOP = dict(
    stage="rl",
    batch_size=2,
    group_size=2,
    prompt_len=20,
    response_len=4,
    seq_len=16,
    warmup_steps=0,
    eval_every=1000,
    eval_batches=1,
    save_every=1000,
    max_bytes=64 << 10,
    ppo_epochs=1,
    minibatches=2,
    lr=1e-2,
    rollout_engine="policy",
    push_every=2,
    max_staleness=1,
)


def test_async_loop_records_the_per_layer_overlap(tmp_path):
    trainer = Trainer(TrainConfig(**dict(LOOP, steps=3, topk_replay=True)), tmp_path)
    try:
        trainer.run(progress=False)
    finally:
        rl_async.close(trainer)
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    layers = trainer.model.config.indexer_types.count("full")
    for r in recs:
        assert r["topk_overlap"] == 1.0 and r["topk_overlap_layers"] == [1.0] * layers
        assert 0 < r["topk_indexer_overlap"] <= 1
    pytest.importorskip("matplotlib")
    from glm5.train.plots import plot_metrics

    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png").read_bytes()
    assert int.from_bytes(png[20:24], "big") == 3 * 400  # IHDR height: a third row, the top-k overlap


@pytest.mark.parametrize("flag", ["--topk-replay", "--topk-record"])
def test_flags_need_a_rollout_engine(tmp_path, flag):
    res = CliRunner().invoke(
        main, ["train", "--stage", "rl", "--steps", "1", "--out", str(tmp_path / "r"), flag]
    )
    assert res.exit_code == 2, res.output
    assert f"{flag.removeprefix('--').replace('-', '_')}: expected a rollout engine" in res.output
    assert "Traceback" not in res.output


def _dp_worker(rank: int, world: int, out: str) -> list[dict] | None:
    from glm5.train.distributed.mesh import Mesh

    cfg = TrainConfig(**dict(LOOP, steps=2, push_every=1, max_staleness=0, topk_replay=True))
    trainer = Trainer(cfg, out, mesh=Mesh(dp=world))
    try:
        trainer.run(progress=False)
    finally:
        rl_async.close(trainer)
    return None if rank else [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_trainer_at_dp2_replays_its_share_of_the_record(tmp_path):
    """dp = 2: rank 0's engine records every row, broadcasts the record with the responses, and each rank
    replays its own rows (a wrong share would fail the token check of the replay); the figures summed over
    the ranks."""
    from tests.ranks import run_ranks

    recs = run_ranks(_dp_worker, 2, str(tmp_path))[0]
    assert len(recs) == 2
    for r in recs:
        assert r["topk_overlap"] == 1.0 and 0 < r["topk_indexer_overlap"] <= 1
