"""Run one vLLM engine on a GLM-5 checkpoint through the plugin, split over tensor_parallel_size CPU workers
(optionally with expert parallel), and print one JSON line; tests/vllm/test_tp.py runs it in a fresh process.

    python tests/vllm/parallel_engine.py '{"model": DIR, "prompts": [[1, 2], ...], "tensor_parallel_size": 2}'

"data_parallel_size": N runs N engines, one process each, as vLLM's offline data-parallel example does
(vLLM refuses `LLM(data_parallel_size=N)` in one process): the environment names each its data-parallel
rank (VLLM_DP_RANK, VLLM_DP_SIZE, VLLM_DP_MASTER_IP / PORT), rank r gets prompts r, r + N, ..., and the
results come back merged in prompt order, the per-worker lists in data-parallel rank order (each engine's
tensor_parallel_size workers in a row).

In order, per spec key: greedy tokens and prompt log-probs of `prompts`; every worker's parameter bytes
(all, those of the plan's split parameters, full and local, and of its experts split by expert parallel,
full and local) and the bytes of its latent and indexer caches that hold rows (a non-zero value: vLLM
allocates the caches zeroed); "update_from": a second float
checkpoint's tensors pushed in place (`update_weights`), then the prompts again ("updated_tokens");
"perturb_layer": rank 1's indexer of that layer fed a perturbed input, then the prompts again, the error
kept ("perturbed"); "probe": true (tensor_parallel_size 1): tests/vllm/pools_engine.py's probe of the cache
ops and copies ("probe"), so that one engine answers tests/vllm/test_generate.py, test_tp.py and
test_pools_engine.py (tests/vllm/conftest.py: reference_tp1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends functions to workers


def _bytes(m) -> dict:
    from vllm.distributed.parallel_state import get_tp_group

    plan = getattr(m.glm, "glm5_plan", {})
    params = {**dict(m.glm.named_parameters()), **dict(m.glm.named_buffers())}  # quantized weights: buffers
    split = [params[n] for n in plan]
    full = sum(_numel(info.full_shape) * params[n].element_size() for n, info in plan.items())
    experts = {n: info for n, info in plan.items() if info.kind == "experts-ep"}
    return {
        "rank": get_tp_group().rank_in_group,
        "all": sum(p.numel() * p.element_size() for p in params.values()),
        "split_local": sum(p.numel() * p.element_size() for p in split),
        "split_full": full,
        "experts_local": sum(params[n].numel() * params[n].element_size() for n in experts),
        "experts_full": sum(_numel(i.full_shape) * params[n].element_size() for n, i in experts.items()),
    }


def _cache_bytes(m) -> dict:
    """Bytes of this worker's latent and indexer caches in rows that hold a token (zero: never written)."""
    from vllm.distributed.parallel_state import get_dp_group

    def held(layers) -> tuple[int, int]:
        rows = nbytes = 0
        for layer in layers:
            c = layer.kv_cache  # [num_blocks, block_size, width]: the one-tensor layout of the reference
            n = int((c.reshape(-1, c.shape[-1]) != 0).any(dim=1).sum())
            rows, nbytes = rows + n, nbytes + n * c.shape[-1] * c.element_size()
        return rows, nbytes

    (latent_rows, latent), (_, indexer) = held(m.latent_caches), held(m.index_caches)
    dp = get_dp_group().rank_in_group
    return {"dp_rank": dp, "latent_rows": latent_rows, "latent": latent, "indexer": indexer}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# apply_model pickles what it sends to the workers: module-level functions (and partials of them) only
def _stats(m) -> dict:
    return m.stats()


def _negate_qr(module, args: tuple) -> tuple:
    return (args[0], -args[1], *args[2:])


def _perturb(layer: int, m) -> int:
    from vllm.distributed.parallel_state import get_tp_group

    if get_tp_group().rank_in_group != 1:
        return 0
    m.glm.model.layers[layer].self_attn.indexer.register_forward_pre_hook(_negate_qr)
    return 1


def _update(pairs, m) -> int:
    return len(m.update_weights(pairs))


def data_parallel(spec: dict) -> dict:
    """N engine processes, one per data-parallel rank, their results merged."""
    n = spec["data_parallel_size"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            VLLM_DP_RANK=str(r),
            VLLM_DP_RANK_LOCAL=str(r),
            VLLM_DP_SIZE=str(n),
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=str(port),
        )
        mine = {**spec, "prompts": spec["prompts"][r::n], "data_parallel_size": 1}
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, json.dumps(mine)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = []
    for r, p in enumerate(procs):
        stdout, _ = p.communicate()
        lines = [ln for ln in stdout.splitlines() if ln.startswith("GLM5-RESULT ")]
        sys.stderr.write("".join(f"[dp {r}] {ln}\n" for ln in stdout.splitlines() if ln not in lines))
        if p.returncode or not lines:
            raise RuntimeError(f"data-parallel rank {r} failed (exit {p.returncode})")
        outs.append(json.loads(lines[-1].removeprefix("GLM5-RESULT ")))
    merged = {key: max(o[key] for o in outs) for key in ("start_s", "generate_s")}
    for key in ("tokens", "prompt_logprobs"):
        merged[key] = [outs[i % n][key][i // n] for i in range(len(spec["prompts"]))]
    for key in ("bytes", "cache_bytes"):  # one entry per worker
        merged[key] = [w for o in outs for w in o[key]]
    merged["stats"] = [o["stats"] for o in outs]  # one per engine
    return merged


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("data_parallel_size", 1) > 1:
        return data_parallel(spec)

    probe = None
    if spec.get("probe"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.vllm.pools_engine import install

        probe = install(spec)
    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        hf_overrides={"architectures": ["Glm5BackendsForCausalLM"]},
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=spec.get("block_size", 16),
        max_model_len=256,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 16),  # chunked prefill
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 24,
        dtype=spec.get("dtype", "float32"),
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        enable_expert_parallel=spec.get("enable_expert_parallel", False),
        load_format=spec.get("load_format", "auto"),
        distributed_executor_backend="mp" if spec.get("tensor_parallel_size", 1) > 1 else None,
    )
    out: dict = {"start_s": time.perf_counter() - t0}
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sp = SamplingParams(
        max_tokens=spec.get("max_tokens", 16),
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        prompt_logprobs=0,
    )

    def run() -> tuple[list, list]:
        res = llm.generate(prompts, sp, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in res]
        plp = [[lp[p].logprob for lp, p in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in res]
        return toks, plp

    t0 = time.perf_counter()
    out["tokens"], out["prompt_logprobs"] = run()
    out["generate_s"] = time.perf_counter() - t0
    out["bytes"] = llm.apply_model(_bytes)
    out["cache_bytes"] = llm.apply_model(_cache_bytes)
    out["stats"] = llm.apply_model(_stats)[0]
    if probe is not None:
        out["probe"] = probe.report()
    if spec.get("update_from"):
        from safetensors.torch import load_file

        from glm5.core.checkpoint import weight_files

        files = set(weight_files(Path(spec["update_from"])).values())
        pairs = [kv for f in sorted(files) for kv in load_file(f).items()]
        out["updated_params"] = llm.apply_model(partial(_update, pairs))
        llm.reset_prefix_cache()
        out["updated_tokens"], _ = run()
    if spec.get("perturb_layer") is not None:
        out["perturbed_ranks"] = llm.apply_model(partial(_perturb, spec["perturb_layer"]))
        try:
            run()
            out["perturbed"] = None
        except Exception as e:  # the worker's TopkDisagreement ends the engine; its text is in stderr
            out["perturbed"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
