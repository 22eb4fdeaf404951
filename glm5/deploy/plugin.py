"""The deployment plan for this project's vLLM plugin (`Glm5BackendsForCausalLM`, docs/vllm.md): the layouts
the plugin serves, their per-device memory, and the command, or why the plugin cannot serve the request.

What the plugin shards (glm5/vllm/model.py, glm5/vllm/parallel.py, glm5/parallel/plan.py):
- tensor parallel inside one node: whole heads of the MLA up-projections, row-parallel o_proj / down
  projections, vocab-parallel embedding and head; router, indexer and the latent / indexer caches whole on
  every rank. A quantized checkpoint (W8A8, W4A8, GLM-5-FP8) is split the same way and read through
  vLLM's weight iterator, each rank reading only its slice of every stored tensor (glm5/weights/load.py):
  at load a rank holds its weights plus one weight in flight (`load_peak_bytes`);
- expert parallel only over the tensor-parallel group (whole experts per TP rank), so no data parallelism
  beside it; no data-parallel attention: data parallelism is whole independent replicas;
- its caches: the model dtype, or `fp8_ds_mla` (656-byte latent rows, plus the 132-byte FP8 indexer cache
  where the backend declares `fp8_indexer_topk`), which needs the backend's FP8 MLA cache ops;
- MTP drafts (`--speculative-config '{"method": "mtp", ...}'`) by the project's MTP layer, split by the
  same plan as the target and sharing the target's (split) embedding and output head (glm5/vllm/mtp.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from glm5.deploy import memory
from glm5.deploy.inventory import ShardError
from glm5.deploy.plan import GIB, Request, weights_for
from glm5.vllm import HF_OVERRIDES

#: GLM5_BACKEND of the plugin per machine vendor
PLUGIN_BACKEND = {"nvidia": "cuda", "ascend": "ascend", "cpu": "cpu"}
#: the backend ops the plugin's fp8_ds_mla cache needs (glm5/vllm/fp8_cache.py)
FP8_CACHE_OPS = ("fp8_mla_cache_quant", "sparse_mla_attention")
#: the cache kinds of FP8 rows the cache-reading ops declare in their caps (backends/cache_layout.py)
FP8_KINDS = ("fp8_ragged", "fp8_paged")


def _serves(be, op: str) -> bool:
    caps = be.capabilities(op)
    return caps is not None and (op == "fp8_mla_cache_quant" or set(FP8_KINDS) <= set(caps.layouts))


def plugin_backend(req: Request) -> str:
    return PLUGIN_BACKEND.get(req.machine.vendor, "reference")


@dataclass
class PluginLayout:
    tp: int
    dp: int
    expert_parallel: bool
    kv_fmt: str
    idx_fmt: str
    violations: list[str] = field(default_factory=list)
    per_device: dict[str, int] = field(default_factory=dict)
    seqs_per_replica: int = 0
    load_peak: int = 0  # bytes a rank holds while loading: its weights + one weight in flight

    @property
    def fits(self) -> bool:
        return not self.violations and self.seqs_per_replica >= 1

    def name(self) -> str:
        return f"DP{self.dp} x TP{self.tp}" + (f" + EP{self.tp}" if self.expert_parallel else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "dp": self.dp,
            "expert_parallel": self.expert_parallel,
            "kv_cache": self.kv_fmt,
            "indexer_cache": self.idx_fmt,
            "fits": self.fits,
            "max_concurrent_seqs": self.dp * self.seqs_per_replica if self.fits else 0,
            "per_device_bytes": self.per_device,
            "load_peak_bytes": self.load_peak,
            "violations": self.violations,
        }


@dataclass
class PluginPlan:
    backend: str
    layout: PluginLayout | None  # the best layout (None: the plugin cannot serve the request at all)
    candidates: list[PluginLayout]
    refused: str | None  # why the plugin cannot serve the request (exit 2 when the plugin is chosen)
    command: str | None

    @property
    def fits(self) -> bool:
        return self.layout is not None and self.layout.fits

    def reason(self) -> str:
        """Why there is no command: refused, or the closest layout's first violation."""
        if self.refused:
            return self.refused
        lay = self.layout
        return lay.violations[0] if lay and lay.violations else "no layout fits"

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "layout": self.layout.to_dict() if self.layout else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "serve_command": self.command,
            "reason": None if self.command else self.reason(),
        }


def _cache_formats(req: Request, be: Any) -> tuple[str, str, str | None]:
    """(latent, indexer) cache formats of the plugin for the request, or a refusal."""
    if req.kv_fmt != "fp8":
        return "bf16", "bf16", None
    if req.machine.vendor == "ascend":  # its 'fp8' cache sizes are vllm-ascend's int8 C8 caches
        return (
            "fp8",
            "fp8",
            (
                f"kv_cache fp8: {req.machine.name} has no FP8 datapath, so the plugin's fp8_ds_mla cache is "
                "not served there (use --kv-cache-dtype bf16)"
            ),
        )
    if be is not None and be.ops:
        missing = [op for op in FP8_CACHE_OPS if not _serves(be, op)]
        if missing:
            return (
                "fp8",
                "fp8",
                (
                    f"kv_cache fp8: the plugin's fp8_ds_mla cache needs {', '.join(missing)}, which backend "
                    f"{be.name!r} does not declare (use --kv-cache-dtype bf16)"
                ),
            )
        return "fp8", "fp8" if _serves(be, "indexer_topk") else "bf16", None
    return "fp8", "fp8", None  # the backend declares its ops only where it runs: planned as declared there


def _evaluate(req: Request, tp: int, dp: int, ep: bool, kv: str, idx: str) -> PluginLayout:
    c, m = req.config, req.machine
    lay = PluginLayout(tp, dp, ep, kv, idx)
    if c.num_attention_heads % tp:
        lay.violations.append(f"attention heads {c.num_attention_heads} do not split over TP{tp}")
    weights = weights_for(c, req.recipe, req.checkpoint_format)
    try:
        main = sum(w.rank_bytes(tp, tp, ep) for w in weights if not w.mtp)
    except ShardError as exc:
        lay.violations.append(str(exc))
        return lay
    draft = 0
    if req.spec:  # the draft: the MTP layers split like the target's; embedding and head are the target's
        draft = sum(w.rank_bytes(tp, tp, ep) for w in weights if w.mtp)
    work = sum(
        memory.workspace(
            c,
            tp,
            tp,
            ep,
            req.batched_tokens,
            req.seqs,
            req.spec,
            int(tp > 1),
            m.comm_buffer_bytes,
            m.reserve_bytes,
        ).values()
    )
    cache = memory.cache_bytes_per_token(c, kv, idx, bool(req.spec))
    tokens = memory.tokens_per_sequence(req.max_model_len, req.spec, m.kv_block_size)
    usable = int(req.util * m.memory_per_device)
    free = usable - main - draft - work
    n = lay.seqs_per_replica = max(free // (cache.total * tokens), 0)
    lay.per_device = {
        "weights": main,
        "mtp_draft": draft,
        "kv_cache": n * cache.kv * tokens,
        "indexer_cache": n * cache.indexer * tokens,
        "workspace": work,
    }
    lay.per_device.update(total=sum(lay.per_device.values()), usable=usable)
    # in flight at load, bounded: the largest stored weight whole (the rank copies only its slice out of
    # vLLM's memory-mapped tensor, but an eager iterator hands it over read) and its slice decoded
    one = max((sum(p.nbytes for p in w.parts) for w in weights if not w.mtp), default=0)
    lay.load_peak = main + draft + 2 * one
    if lay.load_peak > usable:
        lay.violations.append(
            f"{lay.name()}: {lay.load_peak / GIB:.1f} GiB per device at load (the rank's weights and one "
            f"weight in flight) exceed the usable {usable / GIB:.1f} GiB"
        )
    if free < 0:
        lay.violations.append(
            f"{lay.name()}: weights {(main + draft) / GIB:.1f} GiB + workspace {work / GIB:.1f} GiB per "
            f"device exceed the usable {usable / GIB:.1f} GiB"
        )
    elif n < 1:
        lay.violations.append(
            f"{lay.name()}: one sequence of {req.max_model_len} tokens needs "
            f"{cache.total * tokens / GIB:.2f} GiB of cache per device, {free / GIB:.2f} GiB are left"
        )
    return lay


def _layouts(req: Request, kv: str, idx: str) -> list[PluginLayout]:
    per_node, total = req.machine.devices_per_node, req.nodes * req.machine.devices_per_node
    tps = [t for t in range(1, per_node + 1) if per_node % t == 0]
    out = []
    for tp in tps:
        if (req.tp and tp != req.tp) or (req.dp and total // tp != req.dp):
            continue
        out.append(_evaluate(req, tp, total // tp, False, kv, idx))
        if req.expert_parallel and tp > 1 and tp == total:  # EP is the TP group: no DP beside it
            out.append(_evaluate(req, tp, 1, True, kv, idx))
    return out


def plugin_plan(req: Request, model_path: str, served_name: str = "glm-5") -> PluginPlan:
    """The plugin's layouts for the request, the best one, and its command (or why there is none)."""
    from backends.registry import loaded

    name = plugin_backend(req)
    kv, idx, refused = _cache_formats(req, loaded(name))
    if refused:
        return PluginPlan(name, None, [], refused, None)
    cands = _layouts(req, kv, idx)
    if not cands:
        pinned = f"TP{req.tp or '?'} x DP{req.dp or '?'}"
        why = f"tp/dp: {pinned} is not a layout the plugin serves (TP inside one node)"
        return PluginPlan(name, None, [], why, None)
    fitting = [c for c in cands if c.fits]
    best = (
        max(fitting, key=lambda c: (c.dp * c.seqs_per_replica, c.tp, c.expert_parallel))
        if fitting
        else max(cands, key=lambda c: (c.per_device.get("usable", 0) - c.per_device.get("total", 0), c.tp))
    )
    cmd = plugin_command(req, best, model_path, served_name) if best.fits else None
    return PluginPlan(name, best, cands, None, cmd)


def plugin_command(req: Request, lay: PluginLayout, model_path: str, served_name: str = "glm-5") -> str:
    m = req.machine
    args = [
        model_path,
        "--served-model-name",
        served_name,
        "--hf-overrides",
        json.dumps(HF_OVERRIDES),
        "--tensor-parallel-size",
        str(lay.tp),
        "--data-parallel-size",
        str(lay.dp),
    ]
    if lay.expert_parallel:
        args.append("--enable-expert-parallel")
    if lay.kv_fmt == "fp8":
        args += ["--kv-cache-dtype", "fp8_ds_mla"]
    args += [
        "--max-model-len",
        str(req.max_model_len),
        "--max-num-seqs",
        str(req.seqs),
        "--max-num-batched-tokens",
        str(req.batched_tokens),
        "--gpu-memory-utilization",
        f"{req.util:g}",
    ]
    if req.spec:
        args += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": req.spec})]
    args += [str(a) for a in m.engine.get("args") or [] if isinstance(a, str)]  # flags, not graph configs
    words = " ".join(shlex.quote(a) for a in args)
    return f"GLM5_BACKEND={plugin_backend(req)} {m.engine['command']} {words}"
