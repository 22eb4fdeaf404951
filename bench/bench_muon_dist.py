"""Distributed Muon Split: bytes per rank per step, naive vs owner vs split, and seconds per step.

    python bench/bench_muon_dist.py [--ranks 1 2] [--steps 5] [--json PATH]

The tiny model is sharded with FSDP2 over `--ranks` gloo processes on 127.0.0.1 (one thread each) and
stepped with random gradients: the owner and split bytes are measured (`DistributedMuon.last_step_bytes`,
the owner figure with `scheme='owner'`), naive (all-gather every matrix) is analytic. GLM-5's figures
(glm5-744b, bf16, 8 ranks) are analytic (`muon_bytes`). Seconds are the median Muon step per scheme.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.muon.layout import SCHEMES
from glm5.train.muon.optimizer import blocks_for, uses_adamw
from glm5.train.muon.sharded import DistributedMuon
from glm5.train.muon.traffic import muon_bytes, muon_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import gloo_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, steps: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for scheme in ("owner", "split"):
        model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
        model.init_weights(0)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        named = [(n, p) for n, p in model.named_parameters() if not uses_adamw(n, p)]
        blocks = [blocks_for(n, p, model.config, split=True) for n, p in named]
        opt = DistributedMuon([{"params": [p for _, p in named], "blocks": blocks}], lr=1e-3, scheme=scheme)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for _ in range(steps):
            for _, p in named:
                p.grad = DTensor.from_local(
                    torch.randn(p.to_local().shape, generator=gen),
                    mesh,
                    p.placements,
                    shape=p.shape,
                    stride=p.stride(),
                    run_check=False,
                )
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[scheme] = {"bytes": opt.last_step_bytes.total_received, "s": statistics.median(times)}
    queue.put((rank, out))
    dist.destroy_process_group()


def measure(world: int, steps: int) -> list[dict]:
    return gloo_ranks(_rank, world, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="append one JSON object per line to this file")
    args = ap.parse_args()
    rows = []
    tiny = muon_params(GLM5Config.from_preset("tiny"))
    for world in args.ranks:
        per_rank = measure(world, args.steps)
        naive = muon_bytes(None, world, "naive", params=tiny)["total"]
        row = {"model": "tiny", "ranks": world, "naive_bytes": naive}
        for scheme in ("owner", "split"):
            row[f"{scheme}_bytes"] = statistics.mean(r[scheme]["bytes"] for r in per_rank)
            row[f"{scheme}_analytic"] = muon_bytes(None, world, scheme, params=tiny)["total"]
            row[f"{scheme}_step_s"] = max(r[scheme]["s"] for r in per_rank)
        rows.append(row)
        print(
            f"tiny  ranks={world}: naive {naive / 1e6:.3f} MB (analytic), "
            f"owner {row['owner_bytes'] / 1e6:.3f} MB, split {row['split_bytes'] / 1e6:.3f} MB "
            f"per rank per step (measured; analytic "
            f"{row['owner_analytic'] / 1e6:.3f} / {row['split_analytic'] / 1e6:.3f}); Muon step "
            f"owner {row['owner_step_s'] * 1e3:.1f} ms, split {row['split_step_s'] * 1e3:.1f} ms"
        )
    big = muon_params(GLM5Config.from_preset("glm5-744b"))
    for world in (8,):
        fig = {s: muon_bytes(None, world, s, element_size=2, params=big)["total"] for s in SCHEMES}
        rows.append({"model": "glm5-744b", "ranks": world, **{f"{s}_bytes": v for s, v in fig.items()}})
        print(
            f"glm5-744b ranks={world} (bf16, analytic): naive {fig['naive'] / 1e9:.1f} GB, owner "
            f"{fig['owner'] / 1e9:.1f} GB, split {fig['split'] / 1e9:.2f} GB per rank per step "
            f"(split = {100 * fig['split'] / fig['naive']:.2f}% of naive, "
            f"{100 * fig['split'] / fig['owner']:.1f}% of owner)"
        )
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
