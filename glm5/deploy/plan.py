"""The deployment planner: for a model, a recipe, a machine profile and a context length, the per-device
memory of every parallel layout the kernels accept, the largest number of full-length concurrent sequences,
and the layout to serve with.

Layouts: TP x DP = nodes x devices per node, TP inside one node; MoE over all TP x DP ranks (whole experts
per rank with expert parallelism). Memory per device: weights (glm5/deploy/inventory.py) + workspace +
caches (glm5/deploy/memory.py) <= gpu_memory_utilization x device memory, the budget vLLM gives itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from glm5.core.config import GLM5Config
from glm5.deploy import memory
from glm5.deploy.inventory import ShardError, Weight, inventory, meta_model
from glm5.deploy.machines import Machine

GIB = 1 << 30
FLOAT_RECIPE = "bf16"
FP8_RECIPE = "fp8"  # GLM-5-FP8 as published: block FP8 linears and experts (quant/formats/fp8.py)
_CACHE: dict[tuple[str, str, str], list[Weight]] = {}
_MODELS: dict[str, Any] = {}


@dataclass(frozen=True)
class Request:
    config: GLM5Config
    machine: Machine
    recipe: str = "glm5-w4a8"  # a quant/recipes name or path, or 'bf16'
    max_model_len: int = 32768
    nodes: int = 1
    tp: int | None = None
    dp: int | None = None
    expert_parallel: bool = True
    kv_cache: str | None = None  # None: the machine's default
    indexer_cache: str | None = None
    mtp: bool = True
    spec_tokens: int = 3
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    preset: str = "glm5-744b"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "nodes", "max_num_seqs", "max_num_batched_tokens", "tp", "dp"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len: expected <= max_position_embeddings "
                f"{self.config.max_position_embeddings}, got {self.max_model_len}"
            )
        if self.spec_tokens < 0:
            raise ValueError(f"spec_tokens: expected >= 0, got {self.spec_tokens}")
        if self.recipe == FP8_RECIPE and self.machine.vendor != "nvidia":
            raise ValueError(
                f"recipe: {self.machine.name} has no FP8 datapath; convert GLM-5-FP8 with `glm5 quantize "
                "--model FP8_DIR --recipe glm5-w8a8 --format modelslim` and plan that recipe"
            )
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization: expected in (0, 1], got {u}")
        for kind in ("kv_cache", "indexer_cache"):
            v = getattr(self, kind)
            allowed = self.machine.caches[kind]
            if v is not None and v not in allowed:
                raise ValueError(f"{kind}: {self.machine.name} serves {allowed}, got {v!r}")

    # resolved engine settings
    @property
    def kv_fmt(self) -> str:
        return self.kv_cache or self.machine.caches["default"]["kv_cache"]

    @property
    def idx_fmt(self) -> str:
        return self.indexer_cache or self.machine.caches["default"]["indexer_cache"]

    @property
    def util(self) -> float:
        return self.gpu_memory_utilization or self.machine.gpu_memory_utilization

    @property
    def seqs(self) -> int:
        return self.max_num_seqs or int(self.machine.engine.get("max_num_seqs", 16))

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or int(self.machine.engine.get("max_num_batched_tokens", 4096))

    @property
    def spec(self) -> int:
        return self.spec_tokens if self.mtp and self.config.num_nextn_predict_layers else 0

    @property
    def checkpoint_format(self) -> str:
        if self.recipe == FP8_RECIPE:
            return "fp8"
        return "hf" if self.recipe == FLOAT_RECIPE else self.machine.checkpoint_format


@dataclass
class Layout:
    tp: int
    dp: int
    expert_parallel: bool
    violations: list[str] = field(default_factory=list)
    per_device: dict[str, int] = field(default_factory=dict)
    workspace: dict[str, int] = field(default_factory=dict)
    weights_by_role: dict[str, int] = field(default_factory=dict)
    seqs_per_replica: int = 0
    cache_tokens_per_replica: int = 0  # cache slots left for any mix of sequence lengths
    overflow: str = ""

    @property
    def ep(self) -> int:
        return self.tp * self.dp if self.expert_parallel else 1

    @property
    def fits(self) -> bool:
        return not self.violations and self.seqs_per_replica >= 1

    @property
    def max_concurrent_seqs(self) -> int:
        return self.dp * self.seqs_per_replica if not self.violations else 0

    def name(self) -> str:
        return f"DP{self.dp} x TP{self.tp}" + (f" + EP{self.ep}" if self.expert_parallel else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "dp": self.dp,
            "ep": self.ep,
            "expert_parallel": self.expert_parallel,
            "fits": self.fits,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "cache_tokens_per_replica": self.cache_tokens_per_replica,
            "per_device_bytes": self.per_device,
            "violations": self.violations,
            "overflow": self.overflow,
        }


def weights_for(config: GLM5Config, recipe: str, fmt: str) -> list[Weight]:
    """The checkpoint inventory of `config` quantized by `recipe` (or 'bf16') in format `fmt` (cached)."""
    key = (json.dumps(config.to_dict(), sort_keys=True, default=str), recipe, fmt)
    if key not in _CACHE:
        from quant.apply import plan_model
        from quant.recipe import Recipe

        if key[0] not in _MODELS:  # one meta model per config, shared by its recipes
            _MODELS[key[0]] = meta_model(config)
        model = _MODELS[key[0]]
        try:
            if recipe == FP8_RECIPE:
                from quant.formats.fp8 import inventory_plan

                scheme_plan = inventory_plan(model)
            else:
                scheme_plan = {} if recipe == FLOAT_RECIPE else plan_model(model, Recipe.load(recipe))
        except ValueError as exc:
            raise ValueError(f"{exc} (or '{FLOAT_RECIPE}' for the float checkpoint)") from exc
        _CACHE[key] = inventory(model, scheme_plan, fmt)
    return _CACHE[key]


def recipe_formats(recipe: str) -> set[str]:
    """The quantized formats a checkpoint of `recipe` holds: 'bf16', 'FP8', 'W8A8', 'W4A8'."""
    if recipe in (FLOAT_RECIPE, FP8_RECIPE):
        return {"bf16" if recipe == FLOAT_RECIPE else "FP8"}
    from quant.recipe import Recipe

    return {r.scheme.name.split("_")[0] for r in Recipe.load(recipe).rules}


def _kernel_limits(req: Request, weights: list[Weight], tp: int, dp: int, ep: bool) -> list[str]:
    c, lim, out = req.config, req.machine.limits, []
    if req.machine.devices_per_node % tp:
        out.append(
            f"TP{tp} spans nodes: every tensor-parallel group stays inside one node "
            f"({req.machine.devices_per_node} devices, {req.machine.links.get('intra_node', 'one link')})"
        )
    if c.num_attention_heads % tp:
        out.append(f"attention heads {c.num_attention_heads} do not split over TP{tp}")
    else:
        h, heads = c.num_attention_heads // tp, lim.get("attention_heads_per_rank") or {}
        if heads.get("power_of_two") and h & (h - 1):
            out.append(
                f"{h} attention heads per rank: {req.machine.engine_name} sparse attention needs a power "
                "of two"
            )
        if heads.get("max") and h > int(heads["max"]):
            out.append(f"{h} attention heads per rank exceed the sparse attention limit {heads['max']}")
    if lim.get("indexer_heads_max") and c.index_n_heads > int(lim["indexer_heads_max"]):
        out.append(
            f"{c.index_n_heads} indexer heads exceed the lightning indexer limit {lim['indexer_heads_max']}"
        )
    moe_ranks = tp * dp
    if ep and c.n_routed_experts % moe_ranks:
        out.append(f"{c.n_routed_experts} experts are not divisible by the expert-parallel size {moe_ranks}")
    local = c.n_routed_experts // moe_ranks if ep else c.n_routed_experts
    if lim.get("max_local_experts") and local > int(lim["max_local_experts"]):
        out.append(f"{local} experts per rank exceed the grouped matmul limit {lim['max_local_experts']}")
    w4 = [w for w in weights if w.scheme.startswith("W4A8")]
    groups = lim.get("w4a8_group_sizes")
    if groups is not None and any(
        int(w.scheme.split("(g")[1][:-1]) not in groups for w in w4 if "(g" in w.scheme
    ):
        out.append(
            f"per-group int4 weights: {req.machine.engine_name} W4A8 supports group sizes {groups} "
            "(0: per channel)"
        )
    slices = lim.get("w4a8_row_parallel_slices")
    if slices:
        for w in w4:
            split = w.split.removeprefix("expert_")
            parts = (1 if ep else moe_ranks) if w.split.startswith("expert") else tp
            if split == "row" and parts > 1 and int(slices) % parts:
                out.append(
                    f"W4A8 {w.module.split('.')[-1]} row-parallel over {parts} ranks: scale_bias holds "
                    f"{slices} K-slices, the split must divide {slices}"
                )
                break
    return out


def evaluate(req: Request, tp: int, dp: int) -> Layout:
    """Memory and limits of one layout (TP x DP ranks)."""
    ep = req.expert_parallel
    lay = Layout(tp, dp, ep)
    weights = weights_for(req.config, req.recipe, req.checkpoint_format)
    lay.violations = _kernel_limits(req, weights, tp, dp, ep)
    try:
        by_role: dict[str, int] = {}
        for w in weights:
            if w.mtp and not req.mtp:
                continue  # vLLM loads the MTP layer only as the speculative draft
            key = "mtp" if w.mtp else w.role
            by_role[key] = by_role.get(key, 0) + w.rank_bytes(tp, tp * dp, ep)
    except ShardError as exc:
        lay.violations.append(str(exc))
        return lay
    lay.weights_by_role = by_role
    m, c = req.machine, req.config
    groups = sum(n > 1 for n in (tp, dp, tp * dp))
    lay.workspace = memory.workspace(
        c,
        tp,
        tp * dp,
        ep,
        req.batched_tokens,
        req.seqs,
        req.spec,
        groups,
        m.comm_buffer_bytes,
        m.reserve_bytes,
    )
    cache = memory.cache_bytes_per_token(
        c, req.kv_fmt, req.idx_fmt, req.mtp and c.num_nextn_predict_layers > 0
    )
    tokens = memory.tokens_per_sequence(req.max_model_len, req.spec, m.kv_block_size)
    per_seq = cache.total * tokens
    usable = int(req.util * m.memory_per_device)
    weights_b, work = sum(by_role.values()), sum(lay.workspace.values())
    free = usable - weights_b - work
    lay.seqs_per_replica = max(free // per_seq, 0)
    block = m.kv_block_size
    lay.cache_tokens_per_replica = max(free // (cache.total * block), 0) * block
    n = lay.seqs_per_replica
    lay.per_device = {
        "weights": weights_b,
        "kv_cache": n * cache.kv * tokens,
        "indexer_cache": n * cache.indexer * tokens,
        "workspace": work,
    }
    lay.per_device["total"] = sum(lay.per_device.values())
    lay.per_device.update(capacity=m.memory_per_device, usable=usable, per_sequence_cache=per_seq)
    if free < 0:
        lay.overflow = (
            f"weights {weights_b / GIB:.1f} GiB + workspace {work / GIB:.1f} GiB per device exceed the "
            f"usable {usable / GIB:.1f} GiB ({req.util:g} x {m.memory_per_device / GIB:.1f} GiB) by "
            f"{-free / GIB:.1f} GiB, before any KV cache"
        )
    elif n < 1:
        lay.overflow = (
            f"one sequence of {req.max_model_len} tokens needs {per_seq / GIB:.2f} GiB of KV + indexer "
            f"cache per device; {free / GIB:.2f} GiB are left after weights and workspace: short by "
            f"{(per_seq - free) / GIB:.2f} GiB"
        )
    return lay


def layouts(req: Request) -> list[Layout]:
    """Every TP x DP split of the request's devices (pinned tp / dp respected)."""
    total = req.nodes * req.machine.devices_per_node
    out = []
    for tp in range(1, total + 1):
        if total % tp or (req.tp and tp != req.tp) or (req.dp and total // tp != req.dp):
            continue
        out.append(evaluate(req, tp, total // tp))
    if not out:
        raise ValueError(
            f"tp/dp: TP{req.tp or '?'} x DP{req.dp or '?'} does not use the {total} devices of "
            f"{req.nodes} x {req.machine.name}"
        )
    return out


@dataclass
class Plan:
    request: Request
    layout: Layout
    candidates: list[Layout]
    min_nodes: int | None = None  # smallest node count that fits (when this one does not)
    min_nodes_layout: str = ""

    @property
    def fits(self) -> bool:
        return self.layout.fits


def _choose(cands: list[Layout]) -> Layout:
    fitting = [lay for lay in cands if lay.fits]
    if fitting:  # most full-length sequences; among equals the larger TP (fewer replicas, lower latency)
        return max(fitting, key=lambda lay: (lay.max_concurrent_seqs, lay.tp))
    clean = [lay for lay in cands if not lay.violations]
    if clean:
        return max(
            clean,
            key=lambda lay: (
                lay.per_device.get("usable", 0)
                - lay.per_device.get("weights", 0)
                - lay.per_device.get("workspace", 0),
                lay.tp,
            ),
        )
    return max(cands, key=lambda lay: lay.tp)


def make_plan(req: Request, search_nodes: int = 8) -> Plan:
    cands = layouts(req)
    plan = Plan(req, _choose(cands), cands)
    if not plan.fits:
        for k in range(req.nodes + 1, search_nodes + 1):
            try:
                more = layouts(replace(req, nodes=k, dp=None))
            except ValueError:
                continue
            best = _choose(more)
            if best.fits:
                plan.min_nodes, plan.min_nodes_layout = k, best.name()
                break
    return plan
