"""Whole-model prefill on CPU (issue 14): the small-width GLM-5 on the cpu backend against Hugging Face
transformers' `GlmMoeDsaForCausalLM` and our reference backend, same checkpoint, separate processes.

The model: hidden 256, 8 heads, indexer 4 heads x 32, index_topk 512, a dense first layer and one MoE
layer, random weights saved once with `save_pretrained` (published names) and loaded by every variant.
Each variant runs in its own process (a fresh peak RSS: VmHWM after load and runs): a warm-up prefill,
then --runs timed prefills of one --tokens-long request (median). transformers is not a dependency of
this project; the `transformers` variant runs when `import transformers` works in the benchmark's
interpreter (PYTHONPATH may point at a separate install) and is reported as skipped otherwise.

    OMP_NUM_THREADS=2 python bench/bench_cpu_model.py [--tokens 8192] [--runs 3] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit  # noqa: E402

VARIANTS = ("cpu", "reference", "transformers")


def small_config(max_len: int):
    from glm5.core.config import GLM5Config

    return GLM5Config.from_preset(
        "tiny",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=max(max_len, 4096),
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_topk=512,
        index_n_heads=4,
        index_head_dim=32,
        index_topk_pattern="FF",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        num_nextn_predict_layers=0,
    )


def make_checkpoint(path: Path, max_len: int) -> None:
    from glm5.core.model import GLM5ForCausalLM

    GLM5ForCausalLM(small_config(max_len), backend="reference").save_pretrained(path)


def _vmhwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(variant: str, ckpt: Path, tokens: int, runs: int) -> dict:
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (1, tokens))
    if variant == "transformers":
        from transformers import GlmMoeDsaForCausalLM

        model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

        def run():
            return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    else:
        from glm5.core.model import GLM5ForCausalLM

        model = GLM5ForCausalLM.from_pretrained(ckpt, backend=variant).eval()

        def run():
            return model(ids).logits[0, -1]

    with torch.no_grad():
        last = run()  # warm-up (also the answer compared across variants)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return {
        "variant": variant,
        "prefill_s": statistics.median(times),
        "tokens_per_s": tokens / statistics.median(times),
        "peak_rss_mib": _vmhwm_mib(),
        "argmax_last": int(last.argmax()),
        "last_logits": [round(float(v), 5) for v in last[:4]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, Path(a.ckpt), a.tokens, a.runs)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "small-glm5"
        make_checkpoint(ckpt, a.tokens)
        for v in a.variants.split(","):
            cmd = [sys.executable, __file__, "--worker", v, "--ckpt", str(ckpt)]
            cmd += ["--tokens", str(a.tokens), "--runs", str(a.runs)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if p.returncode != 0:
                why = (p.stderr.strip().splitlines() or ["no output"])[-1]
                results[v] = {"variant": v, "skipped": why}
            else:
                results[v] = json.loads(p.stdout.strip().splitlines()[-1])
    ctx = cpu_context()
    base = results.get("transformers", {})
    for r in results.values():
        rec = {"bench": "cpu_model_prefill", "tokens": a.tokens, "runs": a.runs, **r, **ctx}
        if "prefill_s" in r and "prefill_s" in base:
            rec["speedup_vs_transformers"] = round(base["prefill_s"] / r["prefill_s"], 3)
            rec["rss_vs_transformers"] = round(r["peak_rss_mib"] / base["peak_rss_mib"], 3)
        if "prefill_s" in r and "prefill_s" in results.get("reference", {}):
            rec["speedup_vs_reference"] = round(results["reference"]["prefill_s"] / r["prefill_s"], 3)
        emit(rec, a.json)


if __name__ == "__main__":
    main()
