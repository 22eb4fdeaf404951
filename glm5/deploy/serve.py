"""The vLLM / vllm-ascend serve command and environment for a plan, and the plan as JSON or text.

The engine arguments and environment come from the machine profile (for Atlas A3 / A2 the vllm-ascend GLM-5
deployment guide). With more than one node, every node runs its data-parallel
ranks locally: node 0 serves the API, the others join headless (vLLM multi-node data parallelism).

Beside the engine's own GLM-5 (`GlmMoeDsaForCausalLM`), the plan prints the command for this project's vLLM
plugin (`Glm5BackendsForCausalLM`, docs/vllm.md) and which quantized formats each engine can serve there.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from glm5.deploy.plan import FLOAT_RECIPE, GIB, Plan, Request, recipe_formats
from glm5.deploy.plugin import PluginPlan, plugin_backend, plugin_plan

DP_RPC_PORT = 13389

FORMATS = ("bf16", "FP8", "W8A8", "W4A8")
#: what each engine's own GLM-5 serves (the engines' quantization support; issue 15's findings)
NATIVE_FORMATS: dict[str, dict[str, tuple[bool, str]]] = {
    "vllm": {
        "bf16": (True, "float checkpoint"),
        "W8A8": (True, "compressed-tensors int8 x int8 (CompressedTensorsW8A8Int8)"),
        "W4A8": (
            False,
            "vLLM's only int4-weight / int8-activation MoE kernel is for Intel AMX CPUs; on "
            "NVIDIA it serves int4 weights with FP8 activations, not this export",
        ),
        "FP8": (True, "block FP8 (GLM-5-FP8 as published)"),
    },
    "vllm-ascend": {
        "bf16": (True, "float checkpoint"),
        "W8A8": (True, "msModelSlim W8A8_DYNAMIC (--quantization ascend)"),
        "W4A8": (True, "msModelSlim W4A8_DYNAMIC, int4 experts (--quantization ascend)"),
        "FP8": (False, "Ascend A2/A3 have no FP8 datapath"),
    },
}
#: the backend ops (and grouped_matmul dtype) a plugin-served format needs
PLUGIN_NEEDS = {
    "bf16": [
        ("indexer_topk", "bfloat16"),
        ("sparse_mla_attention", "bfloat16"),
        ("grouped_matmul", "bfloat16"),
    ],
    "W8A8": [("dynamic_quant_int8", "bfloat16"), ("w8a8_matmul", "bfloat16"), ("grouped_matmul", "w8a8")],
    "W4A8": [("dynamic_quant_int8", "bfloat16"), ("w8a8_matmul", "bfloat16"), ("grouped_matmul", "w4a8")],
    # GLM-5-FP8 as published: FP8Linear / FP8Experts (quant/fp8_modules.py)
    "FP8": [
        ("fp8_quant_group", "bfloat16"),
        ("fp8_block_matmul", "bfloat16"),
        ("fp8_grouped_matmul", "bfloat16"),
    ],
}


def unservable(req: Request) -> str | None:
    """Why the machine's own engine cannot serve the request's checkpoint (None: it can, or no facts)."""
    m = req.machine
    native = NATIVE_FORMATS.get(m.engine_name, {})
    for f in sorted(recipe_formats(req.recipe)):
        ok, why = native.get(f, (None, ""))
        if ok is False:
            can = sorted(g for g, (yes, _) in native.items() if yes)
            return (
                f"{m.engine_name} on {m.name} cannot serve {req.recipe} ({f}): {why}; it serves "
                f"{', '.join(can)} (the default here: {m.default_recipe})"
            )
    return None


def servable(plan: Plan) -> bool:
    """A serve command is printed only for a plan that fits, in a format the engine serves."""
    return plan.fits and unservable(plan.request) is None


def serve_commands(plan: Plan, model_path: str, served_name: str = "glm-5") -> list[str]:
    """One command per node (node 0 first)."""
    req, lay, m = plan.request, plan.layout, plan.request.machine
    eng = m.engine
    args: list[str] = [
        model_path,
        "--served-model-name",
        served_name,
        "--tensor-parallel-size",
        str(lay.tp),
        "--data-parallel-size",
        str(lay.dp),
    ]
    if lay.expert_parallel:
        args.append("--enable-expert-parallel")
    if req.recipe != FLOAT_RECIPE:
        args += [str(a) for a in eng.get("quantization_args") or []]
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
    args += [str(a) for a in (m.caches.get("kv_cache_args") or {}).get(req.kv_fmt, [])]
    for a in eng.get("args") or []:
        args += [str(x) for x in a] if isinstance(a, list) else [str(a)]
    if req.spec:
        spec = {"num_speculative_tokens": req.spec, **(eng.get("speculative") or {})}
        args += ["--speculative-config", json.dumps(spec)]
    base = f"{eng['command']} " + " ".join(shlex.quote(a) for a in args)
    if req.nodes == 1:
        return [base]
    local = lay.dp // req.nodes
    multi = (
        f" --data-parallel-size-local {local} --data-parallel-address $NODE0_IP "
        f"--data-parallel-rpc-port {DP_RPC_PORT}"
    )
    return [base + multi] + [
        base + multi + f" --headless --data-parallel-start-rank {i * local}" for i in range(1, req.nodes)
    ]


def notes(plan: Plan) -> list[str]:
    req, m = plan.request, plan.request.machine
    out = []
    extra = m.limits.get("notes") or {}
    for key in (req.recipe, f"kv_cache={req.kv_fmt}", f"indexer_cache={req.idx_fmt}"):
        if key in extra:
            out.append(str(extra[key]))
    if m.vendor == "ascend" and "fp8" in (req.kv_fmt, req.idx_fmt):
        out.append(
            "Ascend A2/A3 have no fp8: the 656 / 132-byte cache sizes are vllm-ascend's int8 C8 caches, "
            "which need a *c8 export (not produced by glm5 quantize); no flag is emitted for them"
        )
    if req.mtp and req.config.num_nextn_predict_layers and req.recipe != FLOAT_RECIPE:
        out.append(
            "the MTP layer stays bf16 in the GLM-5 recipes; an export without it (e.g. Eco-Tech/GLM-5-w4a8) "
            "cannot serve MTP: plan with --no-mtp"
        )
    return out


def format_support(plan: Plan) -> dict[str, dict[str, dict[str, Any]]]:
    """engine -> format -> {"ok", "why"}: the machine's own engine, and the plugin on its backend
    (from the backend's declared capabilities, whether or not it can run on this host)."""
    from backends.registry import loaded

    m = plan.request.machine
    native = NATIVE_FORMATS.get(m.engine_name, {})
    out = {
        m.engine_name: {
            f: {"ok": native[f][0], "why": native[f][1]}
            if f in native
            else {"ok": None, "why": f"no facts recorded for {m.engine_name}"}
            for f in FORMATS
        }
    }
    name = plugin_backend(plan.request)
    be = loaded(name)
    plug: dict[str, dict[str, Any]] = {}
    for f in FORMATS:
        if be is None or not be.ops:
            why = (
                "does not load here"
                if be is None
                else f"declares its ops only where it runs ({be.available()[1]})"
            )
            plug[f] = {"ok": None, "why": f"backend {name!r} {why}: run glm5 plan there, or glm5 conformance"}
            continue
        missing = [
            f"{op}[{dt}]"
            for op, dt in PLUGIN_NEEDS[f]
            if be.capabilities(op) is None or dt not in be.capabilities(op).dtypes
        ]
        plug[f] = {
            "ok": not missing,
            "why": f"{name} lacks " + ", ".join(missing)
            if missing
            else f"{name} declares every op it needs; compressed-tensors and msModelSlim both load",
        }
    out[f"vllm + plugin ({name})"] = plug
    return out


def to_json(plan: Plan, model_path: str) -> dict[str, Any]:
    req, lay = plan.request, plan.layout
    cmds = serve_commands(plan, model_path) if servable(plan) else []
    return {
        "fits": plan.fits,
        "model": req.preset,
        "machine": req.machine.name,
        "recipe": req.recipe,
        "checkpoint_format": req.checkpoint_format,
        "nodes": req.nodes,
        "devices": req.nodes * req.machine.devices_per_node,
        "layout": {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "expert_parallel": lay.expert_parallel},
        "max_model_len": req.max_model_len,
        "kv_cache_dtype": req.kv_fmt,
        "indexer_cache_dtype": req.idx_fmt,
        "mtp": bool(req.spec),
        "num_speculative_tokens": req.spec,
        "per_device_bytes": lay.per_device,
        "weights_by_role": lay.weights_by_role,
        "workspace": lay.workspace,
        "max_concurrent_seqs": lay.max_concurrent_seqs,
        "cache_tokens_per_replica": lay.cache_tokens_per_replica,
        "overflow": lay.overflow,
        "violations": lay.violations,
        "min_nodes": plan.min_nodes,
        "min_nodes_layout": plan.min_nodes_layout,
        "serve_command": cmds[0] if cmds else None,
        "serve_commands": cmds,
        "plugin": plugin_plan(req, model_path).to_dict(),
        "formats": format_support(plan),
        "env": req.machine.env(req.recipe),
        "notes": notes(plan),
        "candidates": [c.to_dict() for c in plan.candidates],
    }


def _gib(b: int) -> str:
    return f"{b / GIB:8.2f} GiB"


def to_text(plan: Plan, model_path: str) -> str:
    req, lay, m = plan.request, plan.layout, plan.request.machine
    pd = lay.per_device
    lines = [
        f"{req.preset} {req.recipe} ({req.checkpoint_format}) on {req.nodes} x {m.description}, "
        f"max-model-len {req.max_model_len}, KV {req.kv_fmt}, indexer {req.idx_fmt}"
        + (f", MTP {req.spec}" if req.spec else ""),
        f"layout: {lay.name()}" + ("" if lay.fits else "   DOES NOT FIT"),
    ]
    for v in lay.violations:
        lines.append(f"  violates: {v}")
    if pd:
        lines.append("per device:")
        for role, b in sorted(lay.weights_by_role.items(), key=lambda kv: -kv[1]):
            lines.append(f"  weights/{role:<15}{_gib(b)}")
        for k in ("weights", "kv_cache", "indexer_cache", "workspace", "total", "usable", "capacity"):
            lines.append(f"  {k:<23}{_gib(pd[k])}")
        lines.append(f"  cache per sequence     {_gib(pd['per_sequence_cache'])}")
    lines.append(f"max concurrent sequences at {req.max_model_len} tokens: {lay.max_concurrent_seqs}")
    if lay.cache_tokens_per_replica:
        lines.append(
            f"cache room per replica: {lay.cache_tokens_per_replica} tokens "
            f"(any mix of lengths; --max-num-seqs {req.seqs} is the scheduler's cap)"
        )
    if lay.overflow:
        lines.append(f"overflow: {lay.overflow}")
    if plan.min_nodes:
        lines.append(f"fits with --nodes {plan.min_nodes} ({plan.min_nodes_layout})")
    others = [c for c in plan.candidates if c is not lay]
    if others:
        lines.append(
            "other layouts: "
            + "; ".join(
                f"{c.name()}: "
                + (
                    f"{c.max_concurrent_seqs} sequence(s)"
                    if c.fits
                    else (c.violations[0] if c.violations else "no room")
                )
                for c in others
            )
        )
    for n in notes(plan):
        lines.append(f"note: {n}")
    env = m.env(req.recipe)
    if servable(plan):
        lines.append("environment:")
        lines += [f"  export {k}={shlex.quote(v)}" for k, v in env.items()]
        lines.append("serve:" if req.nodes == 1 else "serve (one command per node, node 0 first):")
        lines += [f"  {c}" for c in serve_commands(plan, model_path)]
    lines += plugin_text(plugin_plan(req, model_path))
    lines.append(f"quantized formats on {m.name}:")
    for engine, fmts in format_support(plan).items():
        cells = ", ".join(
            f"{f} {'yes' if v['ok'] else 'no' if v['ok'] is False else '?'}" for f, v in fmts.items()
        )
        lines.append(f"  {engine}: {cells}")
        why: dict[str, list[str]] = {}
        for f, v in fmts.items():
            if not v["ok"]:
                why.setdefault(v["why"], []).append(f)
        lines += [f"    {'/'.join(fs)}: {w}" for w, fs in why.items()]
    return "\n".join(lines)


def plugin_text(pp: PluginPlan) -> list[str]:
    """The plugin's plan (glm5/deploy/plugin.py): layout, per-device memory, the command or why not."""
    lay = pp.layout
    head = f"serve with the glm5 vLLM plugin (GLM5_BACKEND={pp.backend}, docs/vllm.md)"
    if lay is None:
        return [f"{head}: not served: {pp.reason()}"]
    pd = lay.per_device
    lines = [
        f"{head}: {lay.name()}, caches {lay.kv_fmt} / indexer {lay.idx_fmt}"
        + ("" if lay.fits else "   DOES NOT FIT"),
        "  per device: " + ", ".join(f"{k} {pd[k] / GIB:.2f} GiB" for k in pd),
        f"  per device at load: {lay.load_peak / GIB:.2f} GiB (its own slices read, one weight in flight)",
    ]
    lines.append(f"  {pp.command}" if pp.command else f"  not served: {pp.reason()}")
    return lines
