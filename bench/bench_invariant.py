"""Forward tokens/s of the normal vs the layout-invariant mode (docs/spec.md section 12) on the cpu backend,
in the same run: tiny and a wider config (hidden 1024, 8 heads), median of N, printed as a ratio.

    OMP_NUM_THREADS=1 python bench/bench_invariant.py [--repeats 5] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm5.config import GLM5Config
from glm5.model import GLM5ForCausalLM
from glm5.parallel.invariant import layout_invariant

WIDE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=2048)


def _tokens_per_s(model, ids, invariant: bool, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            if invariant:
                with layout_invariant(model.backend):
                    model(ids)
            else:
                model(ids)
            times.append(time.perf_counter() - start)
    return ids.numel() / statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    for name, overrides in (("tiny", {}), ("wide", WIDE)):
        cfg = GLM5Config.from_preset("tiny")
        for k, v in overrides.items():
            setattr(cfg, k, v)
        model = GLM5ForCausalLM(cfg, backend="cpu")
        ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        normal = _tokens_per_s(model, ids, False, args.repeats)
        inv = _tokens_per_s(model, ids, True, args.repeats)
        print(f"{name}: normal {normal:.0f} tok/s, invariant {inv:.0f} tok/s, cost {normal / inv:.2f}x")


if __name__ == "__main__":
    main()
