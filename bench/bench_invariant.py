"""Forward tokens/s of the normal vs the layout-invariant mode (docs/spec.md section 12) on the cpu backend,
in the same run, interleaved: tiny and a wider config (hidden 1024, 8 heads), median of N, printed as a
ratio.

    OMP_NUM_THREADS=1 python bench/bench_invariant.py [--repeats 5] [--tokens 256]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel.invariant import layout_invariant

#: tiny widened; built by from_preset (validated, the derived fields re-derived), not set on a built config
WIDE = dict(
    hidden_size=1024,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=2048,
    q_lora_rank=256,
    kv_lora_rank=128,
    moe_intermediate_size=256,
)


def _seconds(model, ids, invariant: bool) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward: the CPU time hardly moves with the machine's load."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad(), layout_invariant(model.backend) if invariant else contextlib.nullcontext():
        model(ids)
    return time.perf_counter() - wall, time.process_time() - cpu


def _medians(model, ids, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, CPU) seconds per forward, normal and invariant, the two interleaved so that a load
    that comes and goes weighs on both alike; the first pair warms up (and fills the mode's weight grids)."""
    normal, inv = [], []
    for _ in range(repeats + 1):
        normal.append(_seconds(model, ids, False))
        inv.append(_seconds(model, ids, True))

    def med(runs):
        return tuple(statistics.median(r[i] for r in runs[1:]) for i in (0, 1))

    return med(normal), med(inv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    for name, overrides in (("tiny", {}), ("wide", WIDE)):
        cfg = GLM5Config.from_preset("tiny", **overrides)
        model = GLM5ForCausalLM(cfg, backend="cpu")
        ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        (normal, normal_cpu), (inv, inv_cpu) = _medians(model, ids, args.repeats)
        n = ids.numel()
        print(
            f"{name}: normal {n / normal:.0f} tok/s, invariant {n / inv:.0f} tok/s, cost {inv / normal:.2f}x "
            f"(CPU time: {inv_cpu / normal_cpu:.2f}x)"
        )


if __name__ == "__main__":
    main()
