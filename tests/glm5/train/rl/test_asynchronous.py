"""Asynchronous RL (glm5/train/rl/asynchronous.py) with the in-process policy engine (the project's decode
path on its own copy of the weights, glm5/train/rl/engines/local.py): pushes every K steps reach the engine,
every batch is at most max_staleness versions old, a fully on-policy setting has a mismatch of 1, the options
are checked, and `--rollout-engine vllm` without vLLM is one line with exit code 2. The loop with vLLM as the
engine: tests/vllm/test_rl_async.py."""

from __future__ import annotations

import json
import math
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
from glm5.train.rl.engines.vllm_engine import vllm_installed

ASYNC = dict(
    stage="rl",
    batch_size=2,
    group_size=4,
    prompt_len=8,
    response_len=6,
    seq_len=16,
    warmup_steps=0,
    eval_every=1000,
    eval_batches=1,
    save_every=1000,
    max_bytes=64 << 10,
    ppo_epochs=1,
    lr=1e-2,
    rollout_engine="policy",
)


def _run(out, steps, **kw) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(TrainConfig(**dict(ASYNC, steps=steps, **kw)), out)
    try:
        trainer.run(progress=False)
    finally:
        rl_async.close(trainer)
    return trainer, [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_pushes_reach_the_engine_and_staleness_stays_bounded(tmp_path):
    trainer, recs = _run(tmp_path, 6, push_every=2, max_staleness=2)
    versions = [r["engine_version"] for r in recs]
    # batch n may be sampled by any version >= n - 2 the pushes (after steps 2 and 4) have reached
    assert all(v % 2 == 0 and n - 2 <= v <= n for n, v in enumerate(versions)), versions
    assert versions[3] == 2 and versions[5] == 4, versions  # only the pushed weights satisfy the bound
    assert [r["staleness_max"] for r in recs] == [n - v for n, v in enumerate(versions)]
    assert recs[-1]["engine_pushes"] == 2
    for r in recs:
        assert r["staleness_max"] <= 2 and 0 <= r["overlap"] <= 1
        assert r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
        assert 0 <= r["mismatch_outside"] <= 1 and r["mismatch_min"] <= r["mismatch_max"]
    pytest.importorskip("matplotlib")
    from glm5.train.plots import plot_metrics

    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png").stat().st_size > 0


def test_on_policy_setting_samples_with_the_trainers_weights(tmp_path):
    _, recs = _run(tmp_path, 3, push_every=1, max_staleness=0)
    assert [r["engine_version"] for r in recs] == [0, 1, 2]
    assert [r["staleness_max"] for r in recs] == [0, 0, 0]
    for r in recs:  # the decode path and the training forward differ only by rounding
        assert math.isclose(r["mismatch_min"], 1.0, abs_tol=1e-3)
        assert math.isclose(r["mismatch_max"], 1.0, abs_tol=1e-3)


def test_layout_invariant_mode_makes_the_engine_and_trainer_agree_bitwise(tmp_path):
    """On-policy (K = 1, S = 0) the engine samples with the trainer's weights: with --layout-invariant
    pi_train / pi_rollout is exactly 1 on every token; without it, the decode path and the training
    forward round differently on the cpu backend (so the check can fail)."""
    kw = dict(steps=2, push_every=1, max_staleness=0, backend="cpu", response_len=4)
    _, on = _run(tmp_path / "on", layout_invariant=True, **kw)
    _, off = _run(tmp_path / "off", **kw)
    assert all(r["mismatch_min"] == 1.0 == r["mismatch_max"] for r in on), on
    assert any(r["mismatch_min"] != 1.0 or r["mismatch_max"] != 1.0 for r in off), off
    assert all(r["ppo_ratio_min"] == 1.0 == r["ppo_ratio_max"] for r in on)  # one update a step: r = 1


def test_a_push_replaces_the_engines_weights():
    cfg = GLM5Config.from_preset("tiny")
    a, b = (GLM5ForCausalLM(cfg, backend="reference") for _ in range(2))
    a.init_weights(0)
    b.init_weights(1)
    engine = PolicyEngine(cfg, "reference", checkpoint_tensors(a.state_dict(), cfg.tie_word_embeddings))
    prompts = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    before = engine.generate(prompts, 6, temperature=1.0, seed=3)
    assert torch.equal(before.responses, engine.generate(prompts, 6, temperature=1.0, seed=3).responses)
    engine.push(checkpoint_tensors(b.state_dict(), cfg.tie_word_embeddings), 7)
    after = engine.generate(prompts, 6, temperature=1.0, seed=3)
    assert after.version == 7 and engine.pushes == 1
    assert not torch.equal(before.logprobs, after.logprobs)
    for name, p in b.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], p), name


def test_intervals_overlap():
    a, b = rl_async.Intervals(), rl_async.Intervals()
    for s, e in ((0, 2), (3, 5)):
        a.add(s, e)
    for s, e in ((1, 4), (4.5, 6)):
        b.add(s, e)
    assert a.total() == 4 and a.overlap(b) == pytest.approx(1 + 1 + 0.5) == b.overlap(a)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(push_every=3, max_staleness=1), "max_staleness"),
        (dict(rollout_engine="ray"), "rollout_engine"),
        (dict(rollout_precision="fp8"), "rollout_precision"),
        (dict(rollout_engine="sync", layout_invariant=True), "layout_invariant"),
    ],
)
def test_options_are_checked(kw, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        TrainConfig(**dict(ASYNC, **kw))


def test_cli_refuses_inconsistent_staleness_and_a_missing_vllm(tmp_path):
    args = ["train", "--stage", "rl", "--steps", "1", "--out", str(tmp_path / "run"), "--quiet"]
    r = CliRunner().invoke(main, [*args, "--rollout-engine", "policy", "--push-every", "3"])
    assert r.exit_code == 2 and "max_staleness: expected >= push_every - 1" in r.output, r.output
    if vllm_installed():
        pytest.skip("vLLM is installed here")
    r = CliRunner().invoke(main, [*args, "--rollout-engine", "vllm"])
    assert r.exit_code == 2 and "vLLM is not installed" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()


def _dp_worker(rank: int, world: int, out: str) -> list[dict] | None:
    from glm5.train.distributed.mesh import Mesh

    cfg = TrainConfig(**dict(ASYNC, steps=3, push_every=1, max_staleness=0))
    trainer = Trainer(cfg, out, mesh=Mesh(dp=world))
    try:
        trainer.run(progress=False)
    finally:
        rl_async.close(trainer)
    if rank:
        return None
    return [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_trainer_at_dp2_feeds_one_engine_with_its_gathered_weights(tmp_path):
    """dp = 2: rank 0's engine samples both ranks' rows; each push gathers the FSDP shards into whole
    tensors. On-policy, the engine's log-probs then match the sharded trainer's forward (a wrong or stale
    gather would put the mismatch far from 1)."""
    from tests.ranks import run_ranks

    recs = run_ranks(_dp_worker, 2, str(tmp_path))[0]
    assert [r["engine_version"] for r in recs] == [0, 1, 2] and recs[-1]["engine_pushes"] == 2
    for r in recs:
        assert r["response_tokens"] == ASYNC["batch_size"] * ASYNC["group_size"] * ASYNC["response_len"]
        assert math.isclose(r["mismatch_min"], 1.0, abs_tol=1e-3), r
        assert math.isclose(r["mismatch_max"], 1.0, abs_tol=1e-3), r
