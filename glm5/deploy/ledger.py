"""The per-rank cost ledger of a layout: FLOPs by op, weight and cache bytes, and bytes through each
collective, for one prefill of S tokens and one decode step of B sequences at context L, per rank.

Derived, not hand-written: the model is built at full size on fake tensors (FakeTensorMode), split by
the parallel plan (glm5/parallel/plan.py) with every group a counting fake host (glm5/deploy/counting.py:
FakeHost inside Counted), and run for the step under CountOps, so the ops, their shapes and the
collectives are those the code issues. Routing on fake tensors has no values: the dispatch's split
sizes are those of balanced routing (every expert the same share of each rank's slots), the one
assumption.

A step per rank: a replica (the tensor-parallel group, or one data-parallel rank) holds `batch`
sequences: prefill one sequence of S new tokens into an empty cache, decode one new token for each of
B sequences with L cached; then the last position's logits, and the MTP layer once on the step's tokens
(one draft). Layouts: TP N (experts whole per rank over the same N ranks with expert parallel: the
tokens are replicated, each rank dispatches a 1/N chunk), and DP N + EP N (data-parallel attention, each
rank its own sequences, experts across the N ranks: `ep_tokens='local'`).

Ideals per rank (the ratios printed): expert FLOPs, the routed experts' FLOPs of the tokens the expert
group holds / N (6 D I per slot and MoE layer run); collective bytes, per kind: all_reduce the ring's
2 (N-1)/N of the tensors summed, all_gather (N-1) x, all_to_all the routed rows whose expert is on another
rank, there and back ((N-1)/N of the rank's own T k rows of D out, 1/N of every other rank's back, per
MoE layer run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from glm5.core.cache import KVCache
from glm5.core.config import GLM5Config
from glm5.deploy.counting import Counted, CountOps, FakeHost

EXPERT_OP = "glm5::grouped_matmul"


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    expert_parallel: bool = True

    def __post_init__(self) -> None:
        if self.tp > 1 and self.dp > 1:
            raise ValueError(
                f"layout: the ledger runs TP N or DP N + EP N, not DP{self.dp} x TP{self.tp} (the plan "
                "serves it, ep_tokens 'tp'; the ledger does not count it yet)"
            )
        if self.dp > 1 and not self.expert_parallel:
            raise ValueError("layout: DP without expert parallel is whole replicas; plan it with --tp 1")

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    def name(self) -> str:
        ep = f" + EP{self.ranks}" if self.expert_parallel and self.ranks > 1 else ""
        return (f"DP{self.dp}" if self.dp > 1 else f"TP{self.tp}") + ep


@dataclass
class RankCost:
    """One rank's counts for one step."""

    rank: int
    flops: Counter[str]  # by op
    bytes: Counter[str]  # by collective kind, on the wire from this rank
    calls: Counter[str]  # collective calls by kind
    weight_bytes: dict[str, int]  # routed_experts / other
    cache_bytes: int
    tokens: int  # tokens this rank's replica runs
    ideal_expert_flops: float = 0.0
    ideal_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def expert_flops(self) -> int:
        return self.flops.get(EXPERT_OP, 0)

    def ratios(self) -> dict[str, float]:
        out = {
            "expert_flops": self.expert_flops / self.ideal_expert_flops if self.ideal_expert_flops else 1.0
        }
        for kind, ideal in self.ideal_bytes.items():
            out[f"{kind}_bytes"] = self.bytes.get(kind, 0) / ideal if ideal else 1.0
        total = sum(self.ideal_bytes.values())
        out["collective_bytes"] = sum(self.bytes.values()) / total if total else 1.0
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "tokens": self.tokens,
            "flops_by_op": dict(self.flops),
            "flops": sum(self.flops.values()),
            "expert_flops": self.expert_flops,
            "collective_bytes": dict(self.bytes),
            "collective_calls": dict(self.calls),
            "weight_bytes": self.weight_bytes,
            "cache_bytes": self.cache_bytes,
            "ideal_expert_flops": self.ideal_expert_flops,
            "ideal_collective_bytes": self.ideal_bytes,
            "ratios": self.ratios(),
        }


def _cache(model, layers: list, batch: int, max_len: int, device: torch.device) -> KVCache:
    c = model.config
    return KVCache(
        [layer.self_attn.indexer is not None for layer in layers],
        batch,
        max_len,
        c.kv_lora_rank + c.qk_rope_head_dim,
        c.index_head_dim,
        dtype=model.dtype,
        device=device,
    )


def _cache_bytes(cache: KVCache) -> int:
    tensors = [kv if isinstance(kv, torch.Tensor) else kv.tensor for kv in cache.kv]
    tensors += [t for t in cache.index_k if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_step(model, batch: int, new: int, context: int, mtp: bool = True) -> int:
    """One step of the (split) model: `batch` sequences of `new` new tokens after `context` cached; the
    last position's logits; the MTP layer once. Returns the cache bytes the step's caches hold."""
    c = model.config
    dev = model.model.embed_tokens.weight.device
    layers = model.model.layers
    main = _cache(model, layers[: c.num_hidden_layers], batch, context + new, dev)
    main.lengths = [context] * batch  # the context is already cached (its rows' values do not matter)
    ids = torch.zeros(batch, new, dtype=torch.int64, device=dev)
    with torch.no_grad():
        out = model(ids, main, return_logits=False)
        model.lm_head(out.hidden_states[:, -1])
        total = _cache_bytes(main)
        if mtp and c.num_nextn_predict_layers:
            draft = _cache(model, layers[c.num_hidden_layers :], batch, context + new, dev)
            draft.lengths = [context] * batch
            model.mtp_forward(ids, out.hidden_states, draft)
            total += _cache_bytes(draft)
    return total


def fake_model(config: GLM5Config, fake: FakeTensorMode) -> nn.Module:
    """The model with every tensor a fake one on the CPU (shapes and dtypes, no memory): built on the meta
    device, then each parameter and buffer replaced under `fake`, so the backend sees CPU tensors and
    its custom ops run their fakes."""
    from glm5.deploy.inventory import meta_model

    model = meta_model(config)
    with fake:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype), p.requires_grad
                    )
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def _groups(layout: Layout, rank: int, counter: CountOps, tokens: int) -> tuple[Counted, Counted | None, str]:
    """(tp group, expert group or None, ep_tokens) of `rank`, each a Counted FakeHost."""
    if layout.dp > 1:
        return Counted(FakeHost(0, 1, counter)), Counted(FakeHost(rank, layout.dp, counter)), "local"
    tp = Counted(FakeHost(rank, layout.tp, counter, tokens))
    return tp, (tp if layout.expert_parallel else None), "replicated"


def rank_cost(
    config: GLM5Config, layout: Layout, rank: int, batch: int, new: int, context: int, mtp: bool = True
) -> RankCost:
    """Build the model on fake tensors, split it as `layout`'s rank `rank`, run one step and count."""
    from glm5.parallel import plan

    counter = CountOps()
    tp, ep, tokens = _groups(layout, rank, counter, batch * new)
    with FakeTensorMode() as fake:
        model = fake_model(config, fake)
        plan.apply(model, tp=tp, ep=ep, ep_tokens=tokens)
        with counter:
            cache = run_step(model, batch, new, context, mtp)
    groups = list({id(g): g for g in (tp, ep) if g is not None}.values())
    return _cost(model, layout, rank, counter, groups, cache, batch * new)


def _cost(
    model, layout: Layout, rank: int, counter: CountOps, groups: list, cache: int, tokens: int
) -> RankCost:
    weights = {"routed_experts": 0, "other": 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        key = "routed_experts" if ".mlp.experts." in name else "other"
        weights[key] += t.numel() * t.element_size()
    sent, calls, tensor = Counter(), Counter(), Counter()
    for g in groups:
        sent.update(g.bytes)
        calls.update(g.calls)
        tensor.update(g.tensor_bytes)
    cost = RankCost(rank, counter.flops, sent, calls, weights, cache, tokens)
    ideal_from_counts(cost, model, layout, counter, tensor)
    return cost


def ideal_from_counts(cost: RankCost, model, layout: Layout, counter: CountOps, tensor: Counter) -> None:
    """Fill `cost`'s ideals: expert FLOPs from the MoE layers the step ran (grouped_matmul calls / 3) and
    the tokens the expert group holds; bytes from the tensors summed and gathered and the routed rows."""
    c = model.config
    n = layout.ranks
    moe_runs = counter.calls.get(EXPERT_OP, 0) // 3  # gate, up, down per MoE layer run
    per_slot = 6 * c.hidden_size * c.moe_intermediate_size
    group_tokens = cost.tokens * (layout.dp if layout.dp > 1 else 1)
    cost.ideal_expert_flops = moe_runs * group_tokens * c.num_experts_per_tok * per_slot / max(n, 1)
    if n == 1:
        return
    b = model.dtype.itemsize
    ideal = {}
    if tensor.get("all_reduce"):
        ideal["all_reduce"] = 2 * (n - 1) / n * tensor["all_reduce"]
    if tensor.get("all_gather"):
        ideal["all_gather"] = (n - 1) * tensor["all_gather"]
    if layout.expert_parallel:
        chunk = -(-cost.tokens // n)  # replicated tokens: rank r dispatches chunk r
        mine = cost.tokens if layout.dp > 1 else min(chunk, max(cost.tokens - cost.rank * chunk, 0))
        others = (n - 1) * cost.tokens if layout.dp > 1 else cost.tokens - mine
        # dispatch: (N-1)/N of this rank's rows leave; combine: the 1/N of every other rank's come back
        rows = (n - 1) * mine + others
        ideal["all_to_all"] = moe_runs * rows * c.num_experts_per_tok / n * c.hidden_size * b
    cost.ideal_bytes = ideal


@dataclass(frozen=True)
class Step:
    name: str  # 'prefill' | 'decode'
    batch: int
    new: int
    context: int

    def label(self) -> str:
        if self.name == "prefill":
            return f"prefill {self.new}"
        return f"decode {self.batch} x 1 @ {self.context}"


def steps(prefill_len: int, decode_batch: int, decode_context: int) -> list[Step]:
    return [Step("prefill", 1, prefill_len, 0), Step("decode", decode_batch, 1, decode_context)]


def ledger(config: GLM5Config, layout: Layout, todo: list[Step], mtp: bool = True) -> dict[str, list]:
    """Step label -> the RankCost of rank 0 and, where ranks differ (a replicated step whose tokens do not
    split evenly over the tensor-parallel ranks: the last rank dispatches fewer), of the last rank."""
    out = {}
    for s in todo:
        ranks = [0]
        if layout.tp > 1 and layout.expert_parallel and (s.batch * s.new) % layout.tp:
            ranks.append(layout.tp - 1)
        out[s.label()] = [rank_cost(config, layout, r, s.batch, s.new, s.context, mtp) for r in ranks]
    return out


#: ops shown by name in the text (the rest summed as 'other')
_NAMES = {
    "glm5::grouped_matmul": "routed experts (grouped_matmul)",
    "glm5::sparse_mla_attention": "sparse attention",
    "glm5::indexer_topk": "indexer",
    "aten::mm": "linears (mm)",
    "aten::bmm": "MLA absorbed (bmm)",
}


def _g(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} "


def to_text(layout: Layout, costs: dict[str, list]) -> list[str]:
    """The ledger as lines: one column per step (rank 0; a differing last rank in its own column)."""
    cols = [(f"{label}" + (f" r{c.rank}" if c.rank else ""), c) for label, cs in costs.items() for c in cs]
    width = max(24, *(len(n) + 2 for n, _ in cols))
    head = f"ledger per rank, {layout.name()} ({layout.ranks} ranks; balanced routing; run on fake tensors)"
    lines = [head, f"  {'':34}" + "".join(f"{n:>{width}}" for n, _ in cols)]

    def row(name: str, vals: list[str]) -> None:
        lines.append(f"  {name:34}" + "".join(f"{v:>{width}}" for v in vals))

    row("tokens per replica", [str(c.tokens) for _, c in cols])
    row("FLOP", [_g(sum(c.flops.values())) for _, c in cols])
    order = list(_NAMES)
    ops = sorted(
        {op for _, c in cols for op in c.flops},
        key=lambda op: (op not in _NAMES, order.index(op) if op in _NAMES else 0, op),
    )
    for op in ops:
        row(f"  {_NAMES.get(op, op)}", [_g(c.flops.get(op, 0)) for _, c in cols])
    row("expert FLOP / ideal (routed / N)", [f"{c.ratios()['expert_flops']:.3f}" for _, c in cols])
    row("weights B (bf16 model)", [_g(sum(c.weight_bytes.values())) + "B" for _, c in cols])
    row("  routed experts", [_g(c.weight_bytes["routed_experts"]) + "B" for _, c in cols])
    row("cache B (latent + indexer, + MTP)", [_g(c.cache_bytes) + "B" for _, c in cols])
    kinds = sorted({k for _, c in cols for k in c.bytes})
    row("collective B sent", [_g(sum(c.bytes.values())) + "B" for _, c in cols])
    for k in kinds:
        row(f"  {k} ({'/'.join(str(c.calls.get(k, 0)) for _, c in cols[:1])} calls)", [
            _g(c.bytes.get(k, 0)) + "B" for _, c in cols
        ])  # fmt: skip
    row("collective B / ideal (ring, routed)", [f"{c.ratios()['collective_bytes']:.3f}" for _, c in cols])
    return lines
