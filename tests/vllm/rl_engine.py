"""The rollout-engine client of asynchronous RL (glm5/train/rl/engines/vllm_engine.py) in a fresh process
(vLLM keeps process-wide state): start it on one tiny model's weights, sample, push another model's weights in
place, sample again with the same seed; print one JSON line.

    python tests/vllm/rl_engine.py '{"tensor_parallel_size": 2, "layout_invariant": false}'

Prints {"before"/"after": the sampled tokens, "diff_before"/"diff_after": the largest |engine log-prob -
the training forward's log-prob| of the sampled tokens under the weights the engine held (with
"layout_invariant": the engine and the training forward in that mode), "version",
"pushes", "start_s", "push_s", "insecure_serialization": VLLM_ALLOW_INSECURE_SERIALIZATION as the engine
left it}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def main(spec: dict) -> dict:
    import torch

    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from glm5.train.rl.engines.local import checkpoint_tensors
    from glm5.train.rl.engines.vllm_engine import VllmEngine
    from glm5.train.rl.rollout import batch_invariant, sequence_logprobs

    cfg = GLM5Config.from_preset("tiny")
    a, b = (GLM5ForCausalLM(cfg, backend="reference").requires_grad_(False) for _ in range(2))
    a.init_weights(0)
    b.init_weights(1)
    t0 = time.perf_counter()
    engine = VllmEngine(
        a,
        checkpoint_tensors(a.state_dict(), cfg.tie_word_embeddings),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        layout_invariant=spec.get("layout_invariant", False),
    )
    out: dict = {"start_s": time.perf_counter() - t0}
    out["insecure_serialization"] = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")  # the engine's env
    prompts = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    try:
        before = engine.generate(prompts, 8, temperature=1.0, seed=11)
        t0 = time.perf_counter()
        engine.push(checkpoint_tensors(b.state_dict(), cfg.tie_word_embeddings), 2)
        out["push_s"] = time.perf_counter() - t0
        after = engine.generate(prompts, 8, temperature=1.0, seed=11)
        out.update(version=after.version, pushes=engine.pushes)
    finally:
        engine.close()
    for key, model, gen in (("before", a, before), ("after", b, after)):
        out[key] = gen.responses.tolist()
        with batch_invariant(model) if spec.get("layout_invariant") else contextlib.nullcontext():
            train = sequence_logprobs(model, prompts, gen.responses, 1.0)
        out[f"diff_{key}"] = float((train - gen.logprobs).abs().max())
    return out


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
