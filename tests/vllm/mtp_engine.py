"""Run one vLLM engine with MTP speculative decoding through the plugin, split over tensor_parallel_size
CPU workers, and print one JSON line; tests/vllm/conftest.py (mtp_tp1) and test_mtp_tp.py run it in a fresh
process.

    python tests/vllm/mtp_engine.py '{"model": DIR, "prompts": [[1, 2], ...], "tensor_parallel_size": 2,
                                      "num_speculative_tokens": 2}'

Prints {"tokens", "spec_decode": vLLM's counters, "draft": per rank the MTP draft's parameter bytes (its
own, and those of the plan's split parameters, local and full), whether it uses the target's embedding
and head modules, and its draft steps; "stats": rank 0's model step and backend-call counts}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends functions to workers


def _draft(worker) -> dict:
    """The MTP draft of one worker (a module-level function: vLLM pickles it to the workers)."""
    from vllm.distributed.parallel_state import get_tp_group

    draft = worker.model_runner.drafter.model
    target = worker.model_runner.get_model()
    plan = getattr(draft.glm, "glm5_plan", {})
    target_ids = {id(t) for t in [*target.parameters(), *target.buffers()]}
    tensors = {**dict(draft.glm.named_parameters()), **dict(draft.glm.named_buffers())}
    own = {n: t for n, t in tensors.items() if id(t) not in target_ids}  # not the shared embedding / head
    split = {n: own[n] for n in plan if n in own}
    full = 0
    for n, info in plan.items():
        if n in own:
            numel = 1
            for s in info.full_shape:
                numel *= s
            full += numel * own[n].element_size()
    return {
        "rank": get_tp_group().rank_in_group,
        "own": sum(t.numel() * t.element_size() for t in own.values()),
        "split_local": sum(t.numel() * t.element_size() for t in split.values()),
        "split_full": full,
        "split_names": sorted(split),
        "shares_embedding": draft.model.embed_tokens is target.glm.model.embed_tokens,
        "shares_head": draft._modules.get("lm_head") is target.glm.lm_head,
        "draft_steps": draft.counts["draft_steps"],
    }


def _stats(worker) -> dict:
    """The target model's step and backend-call counts on one worker (module level: pickled as _draft)."""
    return worker.model_runner.get_model().stats()


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    tp = spec.get("tensor_parallel_size", 1)
    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        hf_overrides={"architectures": ["Glm5BackendsForCausalLM"]},
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 24,
        dtype="float32",
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        speculative_config={"method": "mtp", "num_speculative_tokens": spec["num_speculative_tokens"]},
        disable_log_stats=False,  # the spec-decode counters need stats
    )
    start_s = time.perf_counter() - t0
    sp = SamplingParams(
        max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "spec_decode": {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
        },
        "draft": llm.collective_rpc(_draft),
        "stats": llm.collective_rpc(_stats)[0],
        "start_s": start_s,
        "generate_s": generate_s,
    }


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
