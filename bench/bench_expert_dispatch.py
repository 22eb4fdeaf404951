"""Expert parallel at EP=2 on gloo: work and bytes per rank of the dispatch (SPEC 11.1) against the ideal,
and seconds per forward against the every-slot masked design it replaced (623cff6) and one process.

    python bench/bench_expert_dispatch.py [--runs 5] [--tokens 256] [--json PATH]

Per config (tiny, and `wide`: tiny with 4x the hidden and expert widths and 16 experts, top-4), on 2
gloo processes on 127.0.0.1, one thread each, reference backend:
- expert rows per rank / the unsplit layer's rows on the batch the group holds (T*k per MoE layer; with
  experts across dp ranks, both ranks' tokens): the rows the busiest rank's grouped_matmul multiplies
  (its last group offset), summed over the MoE layers; under the model's own router and under balanced
  routing (every expert the same number of slots: the target's case, target <= 0.6);
- collective bytes received per rank (all ranks' over all ranks': routing is not symmetric) / the
  ideal: the routed rows whose expert is on the other rank, there and back (dispatch + combine), plus,
  where the ranks hold the same tokens, a ring all-gather of the [T, D] output (target <= 1.25; the
  excess is the per-expert counts); the old design all-gathered [T, k, D] per layer, set against the
  same ideal;
- seconds per forward (median of --runs, the max over ranks): EP=2 on the dispatch (both layouts:
  ranks holding the same tokens; experts across data-parallel ranks each holding half the batch; and
  the same tokens in the masked (decode) mode with capacity C = T/2, which cannot drop), the old
  every-slot design, and one process. The load average is printed with the figures, and the median
  time of one gloo all-to-all of one element, which bounds the seconds on a small or loaded machine;
- exchanges per MoE layer (collective calls over MoE layer runs, counted): the contiguous dispatch 3
  (the counts, read on the host; the rows; combine), the masked one 2 (the counts travel as a header
  of the rows' exchange), each plus 1 all-gather of the outputs where the ranks hold the same tokens;
  the old design 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from backends.moe import dispatch as moe
from backends.moe import expert_parallel as expert_dispatch
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup, sum_in_rank_order

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import gloo_ranks  # noqa: E402

CONFIGS = {
    "tiny": {},
    "wide": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, n_routed_experts=16,
                 num_experts_per_tok=4),
}  # fmt: skip


def _config(name: str) -> GLM5Config:
    cfg = GLM5Config.from_preset("tiny")
    return GLM5Config(**{**cfg.__dict__, **CONFIGS[name]}) if CONFIGS[name] else cfg


class Counting:
    """A group that counts the bytes each collective brings in from other ranks."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.size, self.bytes, self.exchanges = inner, inner.rank, inner.size, 0, 0

    def all_reduce(self, x, exact=False):
        self.exchanges += 1
        self.bytes += 2 * x.numel() * x.element_size() * (self.size - 1) // self.size  # ring
        return self.inner.all_reduce(x, exact=exact)

    def all_gather(self, x, dim):
        self.exchanges += 1
        self.bytes += x.numel() * x.element_size() * (self.size - 1)
        return self.inner.all_gather(x, dim)

    def reduce_scatter(self, x, exact=False):
        self.exchanges += 1
        self.bytes += x.numel() * x.element_size() * (self.size - 1) // self.size
        return self.inner.reduce_scatter(x, exact=exact)

    def all_to_all(self, x, send, recv):
        self.exchanges += 1
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        self.bytes += row * (sum(recv) - recv[self.rank])
        return self.inner.all_to_all(x, send, recv)


def old_every_slot(self, x, ids, w, be):
    """ExpertParallel.forward as of 623cff6: every rank every slot, the others on local expert 0, masked,
    the per-slot outputs summed over the group (its all-reduce: an all-gather and a rank-order sum)."""
    t, k = ids.shape
    rel = ids.to(torch.int64) - self.ep_first
    mine = (rel >= 0) & (rel < self.ep_local)
    d = moe.dispatch(torch.where(mine, rel, 0), self.ep_local)
    y = self.rows(x, d, be)[d.inverse].view(t, k, -1)
    y = torch.where(mine[..., None], y, torch.zeros((), dtype=y.dtype))
    y = sum_in_rank_order(self.ep_group.all_gather(y[None], 0))
    return (y.float() * w.float()[..., None]).sum(dim=1).to(x.dtype)


#: (token, slot) pairs dispatched to another rank's experts, and dispatches, counted around
#: expert_dispatch.dispatch
REMOTE, CALLS = [0], [0]
_dispatch = expert_dispatch.dispatch


def _counting_dispatch(x, lay, group, capacity=None):
    per_rank = lay.per_expert.view(group.size, -1).sum(1)
    REMOTE[0] += int(per_rank.sum() - per_rank[group.rank])
    CALLS[0] += 1
    return _dispatch(x, lay, group, capacity)


def _model(cfg: GLM5Config) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    m = GLM5ForCausalLM(cfg, backend="reference")
    m.init_weights(0)
    return m.eval()


def _ids(cfg, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))


def _time(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows_counted(model) -> list[int]:
    """Wrap every experts module's `rows`: counter[0] adds the rows its grouped_matmul multiplies,
    counter[1] the calls (one per MoE layer run, in every design)."""
    counter = [0, 0]
    for m in model.modules():
        if hasattr(m, "rows"):
            inner = m.rows

            def rows(x, d, be, inner=inner):
                counter[0] += int(d.offsets[-1])
                counter[1] += 1
                return inner(x, d, be)

            m.rows = rows
    return counter


def _balanced(cfg, rank: int, world: int, t: int) -> dict:
    """Dispatch + combine alone on balanced routing (every expert t*k/E slots of each rank)."""
    group = Counting(TorchGroup())
    e, k, d = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    ids = ((torch.arange(t)[:, None] * k + torch.arange(k)[None, :] + rank) % e).to(torch.int32)
    x = torch.randn(t, d)
    REMOTE[0] = 0
    lay = expert_dispatch.layout(ids, e)
    got, dd, h = expert_dispatch.dispatch(x, lay, group)
    expert_dispatch.combine(got[dd.token], torch.ones(t, k), h, group)
    # the unsplit layer on the group's whole batch (world * t tokens) multiplies world * t * k rows
    return {"rows": int(dd.offsets[-1]), "unsplit": world * t * k, "bytes": group.bytes,
            "ideal": 2 * REMOTE[0] * d * x.element_size()}  # fmt: skip


def _layout(
    cfg, ids, unsplit_rows: int, runs: int, tokens: str, old: bool = False, masked: int | None = None
) -> dict:
    group = Counting(TorchGroup())
    model = _model(cfg)
    plan.apply(model, tp=Single(), ep=group, ep_tokens=tokens, ep_masked_tokens=masked)
    if old:
        for m in model.modules():
            if isinstance(m, plan.ExpertParallel):
                m.forward = old_every_slot.__get__(m)
    rows = _rows_counted(model)
    REMOTE[0] = CALLS[0] = 0
    model(ids)
    moe_calls = CALLS[0]  # the MoE layers the forward ran (the MTP layer's does not run here)
    bpe, n, t = ids.new_empty(0, dtype=torch.float32).element_size(), group.size, ids.numel()
    ideal = 2 * REMOTE[0] * cfg.hidden_size * bpe
    if tokens == "replicated":  # the outputs' all-gather at ring cost; the old design dispatched nothing
        ideal += moe_calls * (n - 1) * -(-t // n) * cfg.hidden_size * bpe
    return {
        "rows": rows[0],
        "unsplit": unsplit_rows,
        "bytes": group.bytes,
        "exchanges": group.exchanges / rows[1],
        "ideal": ideal,
        "s": _time(lambda: model(ids), runs),
    }


def _rank(rank: int, world: int, port: int, name: str, tokens: int, runs: int, unsplit: dict, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    expert_dispatch.dispatch = _counting_dispatch
    cfg = _config(name)
    out = {}
    with torch.no_grad():
        ids = _ids(cfg, tokens, 1)
        out["replicated"] = _layout(cfg, ids, unsplit["rows"], runs, "replicated")
        out["old"] = _layout(cfg, ids, unsplit["rows"], runs, "replicated", old=True)
        chunk = -(-tokens // world)  # the masked (decode) mode at this step: C = the chunk, nothing drops
        out["masked"] = _layout(cfg, ids, unsplit["rows"], runs, "replicated", masked=chunk)
        half = _ids(cfg, tokens // world, 2 + rank)  # experts across dp ranks: half the batch each
        out["local"] = _layout(cfg, half, sum(unsplit["half_rows"]), runs, "local")
        out["balanced"] = _balanced(cfg, rank, world, tokens)
        one = torch.zeros(world)  # a gloo round trip (one element each way): what bounds the seconds here
        out["round_trip_s"] = _time(lambda: TorchGroup().all_to_all(one, [1] * world, [1] * world), 20)
    queue.put((rank, out))
    dist.destroy_process_group()


def measure(name: str, tokens: int, runs: int, world: int = 2) -> dict:
    """One process first (rows and seconds), then `world` gloo ranks."""
    torch.set_num_threads(1)
    cfg = _config(name)
    with torch.no_grad():
        model = _model(cfg)
        rows = _rows_counted(model)
        ids = _ids(cfg, tokens, 1)
        model(ids)
        unsplit = {"rows": rows[0], "half_rows": []}
        single_s = _time(lambda: model(ids), runs)
        for r in range(world):
            rows[0] = 0
            model(_ids(cfg, tokens // world, 2 + r))
            unsplit["half_rows"].append(rows[0])
    per_rank = gloo_ranks(_rank, world, name, tokens, runs, unsplit)
    row = {"config": name, "tokens": tokens, "ep": world, "single_s": single_s}
    row["round_trip_s"] = max(r["round_trip_s"] for r in per_rank)
    for key in ("replicated", "masked", "local", "old", "balanced"):
        # rows: the busiest rank over the unsplit layer on the batch the group holds; bytes: per rank on
        # average (all ranks' received bytes over all ranks' ideal: routing need not be symmetric); the old
        # design is set against the dispatch's ideal for the same tokens
        ideal = sum(r["replicated" if key in ("old", "masked") else key]["ideal"] for r in per_rank)
        row[f"{key}_rows_max"] = max(r[key]["rows"] / r[key]["unsplit"] for r in per_rank)
        row[f"{key}_bytes"] = sum(r[key]["bytes"] for r in per_rank) / ideal
        if "s" in per_rank[0][key]:
            row[f"{key}_s"] = max(r[key]["s"] for r in per_rank)
            row[f"{key}_exchanges"] = max(r[key]["exchanges"] for r in per_rank)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None, help="append one JSON object per line to this file")
    args = ap.parse_args()
    for name in CONFIGS:
        load = os.getloadavg()[0]
        row = measure(name, args.tokens, args.runs)
        row["load_1min"] = load
        print(
            f"{name} T={args.tokens} EP=2 (load {load:.1f} on {os.cpu_count()} cpus): expert rows per rank / "
            f"unsplit: balanced {row['balanced_rows_max']:.3f}, model routing "
            f"{row['replicated_rows_max']:.3f} (same tokens) {row['local_rows_max']:.3f} (dp ranks), "
            f"old design {row['old_rows_max']:.3f}; "
            f"bytes / ideal: balanced {row['balanced_bytes']:.3f}, same tokens "
            f"{row['replicated_bytes']:.3f} (masked mode {row['masked_bytes']:.2f}), dp ranks "
            f"{row['local_bytes']:.3f}, old design "
            f"{row['old_bytes']:.2f}; s per forward: one process {row['single_s'] * 1e3:.1f} ms, "
            f"EP=2 same tokens {row['replicated_s'] * 1e3:.1f} ms (masked mode, C = T/2: "
            f"{row['masked_s'] * 1e3:.1f} ms; old design {row['old_s'] * 1e3:.1f} ms), "
            f"EP=2 dp ranks (half the batch each) {row['local_s'] * 1e3:.1f} ms; one gloo all-to-all round "
            f"trip {row['round_trip_s'] * 1e3:.2f} ms; exchanges per MoE layer: same tokens "
            f"{row['replicated_exchanges']:.0f}, masked {row['masked_exchanges']:.0f}, dp ranks "
            f"{row['local_exchanges']:.0f}, old design {row['old_exchanges']:.0f}"
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
