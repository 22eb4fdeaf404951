"""The RL stage (glm5/train/rl/stage.py): IcePop on the policy's own rollouts raises a verifiable reward on
the tiny preset (and does not without updates), pop() acts inside the loop when the rollout log-probs
disagree with the training forward, the first update's PPO ratio is exactly 1 when the rollout engine is
the policy, the FP8 rollout policy runs, resume is bit-exact, and the CLI takes and checks the options."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from glm5.cli import main
from glm5.train.loop.trainer import TrainConfig, Trainer
from glm5.train.rl import stage as rl
from tests.glm5.train._runs import records

RL = dict(
    stage="rl",
    batch_size=4,
    group_size=8,
    prompt_len=16,
    response_len=16,
    seq_len=32,
    warmup_steps=0,
    eval_every=1000,
    eval_batches=1,
    save_every=1000,
    max_bytes=256 << 10,
    deterministic=True,
)


def _run(out, steps, resume=False, **kw) -> list[dict]:
    Trainer(TrainConfig(**dict(RL, steps=steps, **kw)), out, resume=resume).run(progress=False)
    return records(out)


def test_reward_rises_under_icepop_and_not_without_updates(tmp_path):
    def span(recs):
        r = [x["reward_mean"] for x in recs]
        return sum(r[:3]) / 3, sum(r[-3:]) / 3

    start, end = span(_run(tmp_path / "rl", 12, lr=1e-2))
    still_start, still_end = span(_run(tmp_path / "lr0", 12, lr=0.0, ppo_epochs=1))
    assert start < 0.05 and end > start + 0.05, (start, end)  # measured: 0.021 -> 0.140
    assert still_end < still_start + 0.02, (still_start, still_end)  # the same prompts, no learning


def _mismatched_sample(monkeypatch):
    """The rollout engine reports pi_rollout = pi / 4 on every odd response: k = 4, outside [1/2, 2]."""
    real = rl.sample

    def sample(policy, prompts, new_tokens, **kw):
        toks, logp = real(policy, prompts, new_tokens, **kw)
        logp = logp.clone()
        logp[1::2] -= math.log(4.0)
        return toks, logp

    monkeypatch.setattr(rl, "sample", sample)


def test_pop_masks_mismatched_tokens_inside_the_loop(tmp_path, monkeypatch):
    _mismatched_sample(monkeypatch)
    trainer = Trainer(TrainConfig(**dict(RL, steps=1, batch_size=2, group_size=4)), tmp_path)
    rec = trainer.train_step(0)
    assert rec["popped"] == 0.5 and math.isclose(rec["mismatch_max"], 4.0, rel_tol=1e-4)

    ro = rl.collect(trainer, 1)
    rows = slice(0, ro.responses.shape[0])

    def grads(adv):
        ro.advantages = adv
        loss, st, _ = rl.minibatch_loss(trainer, ro, rows)
        loss.backward()
        out = [p.grad.clone() for p in trainer.params if p.grad is not None]
        trainer.model.zero_grad(set_to_none=True)
        return out, st

    adv = torch.linspace(-1.0, 1.5, ro.responses.shape[0])  # any non-zero advantages
    base, st = grads(adv.clone())
    assert st.popped == 0.5
    popped_changed = adv.clone()
    popped_changed[1::2] = -3.0 * adv[1::2] + 1.0
    same, _ = grads(popped_changed)
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))  # popped tokens: no gradient
    kept_changed = adv.clone()
    kept_changed[0::2] = -3.0 * adv[0::2] + 1.0
    other, _ = grads(kept_changed)
    assert not all(torch.equal(a, b) for a, b in zip(base, other, strict=True))  # the others carry it


def test_first_update_ratio_is_exactly_one_when_the_engine_is_the_policy(tmp_path):
    trainer = Trainer(TrainConfig(**dict(RL, steps=1, batch_size=2, group_size=4, minibatches=2)), tmp_path)
    ro = rl.collect(trainer, 0)
    for rows in rl.minibatch_rows(ro.responses.shape[0], 2):
        _, st, ratio = rl.minibatch_loss(trainer, ro, rows)
        assert torch.equal(ratio, torch.ones_like(ratio)) and st.clipped == 0 and st.popped == 0
    cfg = TrainConfig(**dict(RL, steps=1, batch_size=2, group_size=4, ppo_epochs=1))
    trainer = Trainer(cfg, tmp_path / "b")
    rec = trainer.train_step(0)
    assert rec["ppo_ratio_min"] == 1.0 == rec["ppo_ratio_max"]
    assert rec["popped"] == 0.0 and rec["clipped"] == 0.0 and abs(rec["mismatch_max"] - 1) < 1e-4


def test_fp8_rollouts_run_a_step_and_report_the_mismatch(tmp_path):
    cfg = TrainConfig(**dict(RL, steps=1, batch_size=2, group_size=4, rollout_precision="fp8"))
    rec = Trainer(cfg, tmp_path).train_step(0)
    # the FP8 engine samples, the bf16 forward recomputes: the ratio leaves 1 (measured ~0.7 .. 1.4)
    assert rec["mismatch_min"] < 0.999 and rec["mismatch_max"] > 1.001
    assert 0 <= rec["popped"] <= 1 and rec["response_tokens"] == 2 * 4 * 16


def test_resume_is_bit_exact(tmp_path):
    # in the LR warm-up, so the schedule does not depend on the total step count
    kw = dict(response_len=8, save_every=2, eval_every=2, warmup_steps=10, lr=3e-2)
    a = _run(tmp_path / "a", 3, **kw)
    _run(tmp_path / "c", 2, **kw)
    c = _run(tmp_path / "c", 3, resume=True, **kw)
    assert [r["step"] for r in a] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in a)
    assert a == c


def test_cli_rl_stage_and_bad_options(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--stage", "rl", "--steps", "1", "--out", str(out), "--quiet", "--no-rollout-check"]
    args += ["--batch-size", "2", "--group-size", "2", "--response-len", "4", "--seq-len", "16"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert records(out)[0]["response_tokens"] == 2 * 2 * 4
    assert "reward_first_step" in json.loads((out / "summary.json").read_text())
    for bad, name in (
        (["--group-size", "1"], "--group-size"),
        (["--minibatches", "3"], "minibatches"),
        (["--temperature", "0"], "--temperature"),
    ):
        res = CliRunner().invoke(main, [*args[:5], "--out", str(tmp_path / "x"), "--batch-size", "2", *bad])
        assert res.exit_code == 2 and name in res.output and "Traceback" not in res.output, res.output
    assert "--ppo-epochs" in CliRunner().invoke(main, ["train", "--help"]).output


def test_bad_rl_options():
    with pytest.raises(ValueError, match="group_size"):
        TrainConfig(stage="rl", group_size=1)
    with pytest.raises(ValueError, match="rollout_precision"):
        TrainConfig(stage="rl", rollout_precision="fp4")
