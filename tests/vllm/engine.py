"""Run one vLLM engine on a GLM-5 checkpoint through the plugin and print one JSON line (the tests run
this file in a fresh process per engine: vLLM keeps process-wide state).

    GLM5_BACKEND=reference python tests/vllm/engine.py '{"model": DIR, "prompts": [[1, 2], ...], ...}'

Prints {"tokens": [[...] per prompt], "prompt_logprobs": [[...]] or null, "start_s", "generate_s" (the
median of `repeats` runs, `generate_runs_s` all of them; time them with "enable_prefix_caching": false),
"stats": the model's step and backend-call counts}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: apply_model is local


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        # only the architecture: the plugin must be found through its vllm.general_plugins entry point
        hf_overrides={"architectures": ["Glm5BackendsForCausalLM"]},
        skip_tokenizer_init=True,
        enforce_eager=spec.get("enforce_eager", True),
        block_size=spec.get("block_size", 16),
        max_model_len=spec.get("max_model_len", 256),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 256),
        max_num_seqs=spec.get("max_num_seqs", 8),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 1 << 24),
        dtype=spec.get("dtype", "float32"),
        seed=0,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        speculative_config=spec.get("speculative_config"),
        disable_log_stats=not spec.get("speculative_config"),  # the spec-decode counters need stats
    )
    start_s = time.perf_counter() - t0
    sp = SamplingParams(
        max_tokens=spec.get("max_tokens", 16),
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        prompt_logprobs=0 if spec.get("prompt_logprobs") else None,
    )
    runs = []  # repeats > 1 (with enable_prefix_caching False): timings of identical runs, for medians
    for _ in range(spec.get("repeats", 1)):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
        runs.append(time.perf_counter() - t0)
    generate_s = sorted(runs)[len(runs) // 2]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    plp = None
    if spec.get("prompt_logprobs"):
        # entry i (i >= 1) holds log p(prompt[i] | prompt[:i]); entry 0 is None
        plp = [[lp[p].logprob for lp, p in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]
    stats = llm.apply_model(lambda m: m.stats())[0]
    spec_decode = {  # vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)
        m.name: m.value
        for m in (llm.get_metrics() if spec.get("speculative_config") else [])
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
    }
    return {
        "generate_runs_s": runs,
        "tokens": tokens,
        "prompt_logprobs": plp,
        "start_s": start_s,
        "generate_s": generate_s,
        "stats": stats,
        "spec_decode": spec_decode,
    }


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
