"""The rollout engine of RL training (glm5/train/rl/engines/vllm_engine.py) on the tiny model, in a fresh
process (vLLM keeps process-wide state), with the indexer top-k record on; its checks run in phases and it
prints one JSON line. One engine answers tests/vllm/test_rl_invariant.py, test_topk_record.py and
test_rl_async.py (tests/vllm/conftest.py: rollout_tp2).

    python tests/vllm/rollout_engine.py '{"tensor_parallel_size": 2, "model": DIR, "sample": {...},
                                          "topk": true, "push": true}'

The engine starts on DIR's weights (A; without "model", the tiny preset's init_weights(0)). Between phases
the prefix cache is reset, so each phase's requests run as on a fresh engine. In this order, per spec key:
- "sample" {"prompts", "new_tokens", "temperature", "seed"}: "sample": the responses, their log-probs and
  the top-k record (test_rl_invariant.py's run without the layout-invariant mode);
- "topk": sample 3 prompts of 24 tokens, each twice (a group: its prefix cached), then the training forward
  over the same tokens with the record -> "shape" (the record's), "overlap" / "overlap_layers" (the
  forward's own top-k against the record), "replayed_equal" (whether a replayed forward attended to
  exactly the recorded sets) (test_topk_record.py);
- "push": sample 4 prompts of 12 tokens, push another model's weights (B, init_weights(1)) in place,
  sample again with the same seed -> "before" / "after" (the tokens), "diff_before" / "diff_after" (the
  largest |engine log-prob - the training forward's| under the weights the engine held), "version",
  "pushes", "push_s" (test_rl_async.py).
Always: "start_s", "insecure_serialization" (VLLM_ALLOW_INSECURE_SERIALIZATION as the engine left it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _topk(engine, model) -> dict:
    import torch

    from glm5.train.rl.topk_replay import RolloutTopk

    cfg = model.config
    p, n = 24, 6  # more keys than index_topk (16)
    prompts = torch.randint(0, 256, (3, p), generator=torch.Generator().manual_seed(0)).repeat_interleave(
        2, 0
    )
    gen = engine.generate(prompts, n, temperature=1.0, seed=11)
    out: dict = {"shape": list(gen.topk.shape)}
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    for replay in (False, True):
        tk = RolloutTopk(prompts, gen.responses, gen.topk, replay)
        tk.measuring = True
        with torch.no_grad(), tk.hooks(model):
            used = model(torch.cat([prompts, gen.responses], 1)[:, :-1], return_topk=True).topk
        fig = tk.figures()
        if replay:
            k = cfg.index_topk
            at = torch.stack([used[i].view(prompts.shape[0], -1, k)[:, p - 1 :] for i in full], 2)
            out["replayed_equal"] = bool(torch.equal(at, gen.topk))
        else:
            out.update(overlap=fig["topk_overlap"], overlap_layers=fig["topk_overlap_layers"])
    return out


def _push(engine, a, b) -> dict:
    import torch

    from glm5.train.rl.engines.local import checkpoint_tensors
    from glm5.train.rl.rollout import sequence_logprobs

    out: dict = {}
    prompts = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    before = engine.generate(prompts, 8, temperature=1.0, seed=11)
    t0 = time.perf_counter()
    engine.push(checkpoint_tensors(b.state_dict(), b.config.tie_word_embeddings), 2)
    out["push_s"] = time.perf_counter() - t0
    after = engine.generate(prompts, 8, temperature=1.0, seed=11)
    out.update(version=after.version, pushes=engine.pushes)
    for key, model, gen in (("before", a, before), ("after", b, after)):
        out[key] = gen.responses.tolist()
        train = sequence_logprobs(model, prompts, gen.responses, 1.0)
        out[f"diff_{key}"] = float((train - gen.logprobs).abs().max())
    return out


def main(spec: dict) -> dict:
    import torch

    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from glm5.loader import load_model
    from glm5.train.rl.engines.local import checkpoint_tensors
    from glm5.train.rl.engines.vllm_engine import VllmEngine

    cfg = GLM5Config.from_preset("tiny")
    if spec.get("model"):
        a = load_model(Path(spec["model"]), backend="reference")
    else:
        a = GLM5ForCausalLM(cfg, backend="reference")
        a.init_weights(0)
    a.requires_grad_(False)
    t0 = time.perf_counter()
    engine = VllmEngine(
        a,
        checkpoint_tensors(a.state_dict(), a.config.tie_word_embeddings),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        record_topk=True,
    )
    out: dict = {"start_s": time.perf_counter() - t0}
    out["insecure_serialization"] = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")  # the engine's env
    try:
        if spec.get("sample"):
            s = spec["sample"]
            gen = engine.generate(
                torch.tensor(s["prompts"]), s["new_tokens"], temperature=s["temperature"], seed=s["seed"]
            )
            out["sample"] = {
                "responses": gen.responses.tolist(),
                "logprobs": gen.logprobs.tolist(),
                "topk": gen.topk.tolist(),
            }
            engine.llm.reset_prefix_cache()
        if spec.get("topk"):
            out.update(_topk(engine, a))
            engine.llm.reset_prefix_cache()
        if spec.get("push"):
            b = GLM5ForCausalLM(a.config, backend="reference").requires_grad_(False)
            b.init_weights(1)
            out.update(_push(engine, a, b))
    finally:
        engine.close()
    return out


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
