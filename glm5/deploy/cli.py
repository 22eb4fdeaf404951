"""`glm5 plan --config glm5-744b --machine atlas-800t-a3 --recipe glm5-w4a8 --max-model-len N [--nodes K]`.

Bad input (a value out of range, a layout that does not use the machine's devices, an unreadable config or
profile, a recipe the machine's engine cannot serve) is one line naming the option, exit code 2; exit 1
is kept for "nothing fits"."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from glm5.deploy.machines import available as machines_available

#: the Request field a ValueError names (its message starts "field: ...") -> the option that sets it
_OPTION_OF = {
    "max_model_len": "--max-model-len",
    "nodes": "--nodes",
    "tp": "--tp",
    "dp": "--dp",
    "tp/dp": "--tp / --dp",
    "spec_tokens": "--spec-tokens",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache": "--kv-cache-dtype",
    "indexer_cache": "--indexer-cache-dtype",
    "recipe": "--recipe",
    "format modelslim": "--recipe",
}
#: what a user-supplied file (JSON / YAML) can raise while it is read and parsed
_BAD_FILE = (ValueError, OSError, TypeError, KeyError, AttributeError)


def _bad_request(exc: ValueError) -> NoReturn:
    """A ValueError of the planner as a usage error on the option its message names."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    field, _, rest = text.partition(": ")
    if rest and field in _OPTION_OF:
        raise click.BadParameter(rest, param_hint=f"'{_OPTION_OF[field]}'") from None
    raise click.UsageError(text) from None


def _file_error(exc: Exception, name: str, what: str) -> str:
    """One line for a YAML file that could not be read or is not the mapping it should be."""
    import yaml

    if isinstance(exc, OSError):
        return f"cannot read {name!r}: {exc.strerror}"
    if isinstance(exc, yaml.YAMLError):
        return f"{name!r} is not valid YAML: {str(exc).splitlines()[0]}"
    if isinstance(exc, ValueError):
        return str(exc).splitlines()[0]
    return f"{name!r} is not a {what} (a YAML mapping of its fields): {type(exc).__name__}: {exc}"


def _load_machine(name: str) -> Any:
    import yaml

    from glm5.deploy.machines import Machine

    try:
        return Machine.load(name)
    except (*_BAD_FILE, yaml.YAMLError) as exc:
        why = _file_error(exc, name, "machine profile")
        raise click.BadParameter(why, param_hint="'--machine'") from None


def _load_config(name: str) -> Any:
    """A preset, or a Hugging Face config.json: one JSON object."""
    from glm5.core.config import GLM5Config

    try:
        return GLM5Config.from_json(name) if name.endswith(".json") else GLM5Config.from_preset(name)
    except _BAD_FILE as exc:
        raise click.BadParameter(str(exc).splitlines()[0], param_hint="'--config'") from None


def _check_recipe(recipe: str) -> None:
    import yaml

    from glm5.deploy.plan import FLOAT_RECIPE, FP8_RECIPE
    from quant.recipe import Recipe

    if recipe in (FLOAT_RECIPE, FP8_RECIPE):
        return
    try:
        Recipe.load(recipe)
    except (*_BAD_FILE, yaml.YAMLError) as exc:
        text = _file_error(exc, recipe, "recipe").removeprefix("recipe: ")
        if text.startswith("expected one of"):
            text += f" (or '{FP8_RECIPE}' for GLM-5-FP8, '{FLOAT_RECIPE}' for the float checkpoint)"
        raise click.BadParameter(text, param_hint="'--recipe'") from None


def _check_split(devices: int, nodes: int, tp: int | None, dp: int | None) -> None:
    """TP and DP must split the nodes' devices: TP x DP = nodes x devices per node."""
    total = nodes * devices
    for opt, v in (("--tp", tp), ("--dp", dp)):
        if v is not None and total % v:
            raise click.BadParameter(
                f"expected a divisor of the {total} devices of {nodes} node(s) x {devices}, got {v}",
                param_hint=f"'{opt}'",
            )
    if tp is not None and dp is not None and tp * dp != total:
        raise click.BadParameter(
            f"TP{tp} x DP{dp} = {tp * dp} devices, expected {total} ({nodes} node(s) x {devices})",
            param_hint="'--tp' / '--dp'",
        )


def _utilization(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:  # also nan
        raise click.BadParameter(f"expected a fraction in (0, 1], got {value}")
    return value


_COUNT = click.IntRange(min=1)


@click.command()
@click.option(
    "--config",
    "config_name",
    default="glm5-744b",
    show_default=True,
    help="model preset (glm5/core/presets) or a Hugging Face config.json path",
)
@click.option(
    "--machine", required=True, help=f"machine profile ({', '.join(machines_available())}) or a YAML path"
)
@click.option(
    "--recipe",
    default=None,
    help="quantization recipe (quant/recipes), 'fp8' (GLM-5-FP8) or 'bf16'; default: the machine's "
    "(engine.default_recipe: glm5-w4a8 on Atlas, fp8 on h200x8)",
)
@click.option("--max-model-len", type=_COUNT, required=True, help="context length every sequence may reach")
@click.option("--nodes", type=_COUNT, default=1, show_default=True)
@click.option(
    "--tp", type=_COUNT, default=None, help="pin the tensor-parallel size (default: the best that fits)"
)
@click.option("--dp", type=_COUNT, default=None, help="pin the data-parallel size")
@click.option("--expert-parallel/--no-expert-parallel", default=True, show_default=True)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["bf16", "fp8"]),
    default=None,
    help="latent KV cache: bf16 (576 x 2 B) or fp8 (656 B); default: the machine's",
)
@click.option(
    "--indexer-cache-dtype",
    type=click.Choice(["bf16", "fp8"]),
    default=None,
    help="indexer key cache: bf16 (128 x 2 B) or fp8 (132 B); default: the machine's",
)
@click.option(
    "--mtp/--no-mtp", default=True, show_default=True, help="MTP speculative decoding (deepseek_mtp)"
)
@click.option(
    "--spec-tokens",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="num_speculative_tokens with MTP",
)
@click.option(
    "--max-num-seqs", type=_COUNT, default=None, help="engine max-num-seqs (default: the machine's)"
)
@click.option("--max-num-batched-tokens", type=_COUNT, default=None)
@click.option(
    "--gpu-memory-utilization",
    type=float,
    default=None,
    callback=_utilization,
    help="fraction of device memory the engine uses, in (0, 1] (default: the machine's)",
)
@click.option("--model-path", default=None, help="checkpoint path for the serve command")
@click.option(
    "--engine",
    type=click.Choice(["native", "plugin"]),
    default="native",
    show_default=True,
    help="plan the machine's own engine, or vLLM with this project's plugin (docs/vllm.md)",
)
@click.option(
    "--ledger",
    is_flag=True,
    help="also run the chosen layout's rank on fake tensors and print its per-rank FLOPs by op, weight and "
    "cache bytes and collective bytes for one prefill and one decode step (glm5/deploy/ledger.py; TP N or "
    "DP N + EP N layouts)",
)
@click.option(
    "--prefill-len",
    type=_COUNT,
    default=None,
    help="ledger: prefill tokens (default: max-num-batched-tokens)",
)
@click.option(
    "--decode-batch", type=_COUNT, default=None, help="ledger: decode sequences per replica (max-num-seqs)"
)
@click.option(
    "--decode-context", type=_COUNT, default=None, help="ledger: cached tokens per sequence (max-model-len)"
)
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def plan(
    config_name: str,
    machine: str,
    recipe: str | None,
    max_model_len: int,
    nodes: int,
    tp: int | None,
    dp: int | None,
    expert_parallel: bool,
    kv_cache_dtype: str | None,
    indexer_cache_dtype: str | None,
    mtp: bool,
    spec_tokens: int,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    gpu_memory_utilization: float | None,
    model_path: str | None,
    as_json: bool,
    engine: str,
    ledger: bool = False,
    prefill_len: int | None = None,
    decode_batch: int | None = None,
    decode_context: int | None = None,
) -> None:
    """Per-device memory, the largest concurrency at MAX_MODEL_LEN, a parallel layout the kernels accept
    and the vLLM / vllm-ascend serve command. A recipe the machine's engine cannot serve is refused (exit
    status 2); exit status 1 when nothing fits (the message says what overflows and by how much)."""
    from glm5.deploy.plan import FP8_RECIPE, Request, make_plan
    from glm5.deploy.serve import to_json, to_text, unservable

    m = _load_machine(machine)
    cfg = _load_config(config_name)
    recipe = recipe or m.default_recipe
    _check_recipe(recipe)
    _check_split(m.devices_per_node, nodes, tp, dp)
    try:
        req = Request(
            cfg,
            m,
            recipe,
            max_model_len,
            nodes,
            tp,
            dp,
            expert_parallel,
            kv_cache_dtype,
            indexer_cache_dtype,
            mtp,
            spec_tokens,
            max_num_seqs,
            max_num_batched_tokens,
            gpu_memory_utilization,
            preset=config_name,
        )
    except ValueError as exc:
        _bad_request(exc)
    if engine == "plugin":
        _plan_plugin(req, model_path, as_json)
        return
    why = unservable(req)
    if why:
        raise click.BadParameter(why, param_hint="'--recipe'")
    try:
        p = make_plan(req)
    except ValueError as exc:
        _bad_request(exc)
    if model_path == "":
        raise click.BadParameter("expected a checkpoint path, got ''", param_hint="'--model-path'")
    if model_path is None:
        model_path = (
            "/models/GLM-5-FP8"
            if recipe == FP8_RECIPE
            else f"/models/GLM-5-{recipe}" + ("" if recipe == "bf16" else f"-{req.checkpoint_format}")
        )
    costs = None
    if ledger:
        costs = _ledger(req, p.layout, prefill_len, decode_batch, decode_context)
    if as_json:
        out = to_json(p, model_path)
        if costs is not None:
            out["ledger"] = {step: [c.to_dict() for c in cs] for step, cs in costs[1].items()}
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(to_text(p, model_path))
        if costs is not None:
            from glm5.deploy.ledger import to_text as ledger_text

            click.echo("\n".join(ledger_text(*costs)))
    if not p.fits:
        lay = p.layout
        why = lay.overflow or "; ".join(lay.violations) or "no layout fits"
        more = f"; fits with --nodes {p.min_nodes} ({p.min_nodes_layout})" if p.min_nodes else ""
        click.echo(f"error: {recipe} does not fit {nodes} x {m.name} ({lay.name()}): {why}{more}", err=True)
        sys.exit(1)


def _ledger(req: Any, lay: Any, prefill: int | None, batch: int | None, context: int | None) -> tuple:
    """(ledger layout, step -> per-rank costs) of the plan's layout; a layout it cannot run: exit 2."""
    from glm5.deploy import ledger

    try:
        layout = ledger.Layout(lay.tp, lay.dp, lay.expert_parallel)
    except ValueError as exc:
        why = str(exc).removeprefix("layout: ")
        raise click.BadParameter(f"{why}; pin --tp N or --dp N", param_hint="'--ledger'") from None
    context = context or req.max_model_len
    if context + 1 > req.config.max_position_embeddings:
        raise click.BadParameter(
            f"expected < max_position_embeddings {req.config.max_position_embeddings}, got {context}",
            param_hint="'--decode-context'",
        )
    todo = ledger.steps(prefill or req.batched_tokens, batch or req.seqs, context)
    return layout, ledger.ledger(req.config, layout, todo, mtp=req.mtp)


def _plan_plugin(req: Any, model_path: str | None, as_json: bool) -> None:
    """`glm5 plan --engine plugin`: the plugin's layouts and command; a request it cannot serve exits 2 with
    the reason, one that does not fit exits 1 (as for the engine's own plan)."""
    from glm5.deploy.plugin import plugin_plan
    from glm5.deploy.serve import plugin_text

    if model_path == "":
        raise click.BadParameter("expected a checkpoint path, got ''", param_hint="'--model-path'")
    pp = plugin_plan(req, model_path or f"/models/GLM-5-{req.recipe}")
    if pp.refused:
        raise click.BadParameter(pp.refused, param_hint="'--engine'")
    click.echo(json.dumps(pp.to_dict(), indent=2) if as_json else "\n".join(plugin_text(pp)))
    if not pp.fits:
        click.echo(
            f"error: the plugin cannot serve {req.recipe} on {req.nodes} x {req.machine.name}: {pp.reason()}",
            err=True,
        )
        sys.exit(1)
