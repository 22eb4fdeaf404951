"""The vLLM rollout engine recording the indexer top-k (glm5/train/rl/engines/vllm_engine.py with record_topk,
glm5/train/rl/topk_replay.py) in a fresh process (vLLM keeps process-wide state): sample, then run the
training forward over the same tokens with the record; print one JSON line.

    python tests/vllm/topk_engine.py '{"tensor_parallel_size": 1}'

Prints {"shape": the record's shape, "overlap" / "overlap_layers": the training forward's own top-k
against the engine's record, "replayed_equal": whether a replayed training forward attended to exactly the
recorded sets}.
"""

from __future__ import annotations

import json
import sys


def main(spec: dict) -> dict:
    import torch

    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from glm5.train.rl.engines.local import checkpoint_tensors
    from glm5.train.rl.engines.vllm_engine import VllmEngine
    from glm5.train.rl.topk_replay import RolloutTopk

    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, backend="reference").requires_grad_(False)
    engine = VllmEngine(
        model,
        checkpoint_tensors(model.state_dict(), cfg.tie_word_embeddings),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        record_topk=True,
    )
    p, n = 24, 6  # more keys than index_topk (16); each prompt twice (a group: its prefix cached)
    prompts = torch.randint(0, 256, (3, p), generator=torch.Generator().manual_seed(0)).repeat_interleave(
        2, 0
    )
    try:
        gen = engine.generate(prompts, n, temperature=1.0, seed=11)
    finally:
        engine.close()
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


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
