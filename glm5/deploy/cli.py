"""`glm5 plan --config glm5-744b --machine atlas-800t-a3 --recipe glm5-w4a8 --max-model-len N [--nodes K]`."""

from __future__ import annotations

import json
import sys

import click

from glm5.deploy.machines import available as machines_available


@click.command()
@click.option(
    "--config",
    "config_name",
    default="glm5-744b",
    show_default=True,
    help="model preset (glm5/presets) or a Hugging Face config.json path",
)
@click.option(
    "--machine", required=True, help=f"machine profile ({', '.join(machines_available())}) or a YAML path"
)
@click.option(
    "--recipe", default="glm5-w4a8", show_default=True, help="quantization recipe (quant/recipes) or 'bf16'"
)
@click.option("--max-model-len", type=int, required=True, help="context length every sequence may reach")
@click.option("--nodes", type=int, default=1, show_default=True)
@click.option(
    "--tp", type=int, default=None, help="pin the tensor-parallel size (default: the best that fits)"
)
@click.option("--dp", type=int, default=None, help="pin the data-parallel size")
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
@click.option("--spec-tokens", type=int, default=3, show_default=True, help="num_speculative_tokens with MTP")
@click.option("--max-num-seqs", type=int, default=None, help="engine max-num-seqs (default: the machine's)")
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--model-path", default=None, help="checkpoint path for the serve command")
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def plan(
    config_name: str,
    machine: str,
    recipe: str,
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
) -> None:
    """Per-device memory, the largest concurrency at MAX_MODEL_LEN, a parallel layout the kernels accept
    and the vLLM / vllm-ascend serve command. Exit status 1 when nothing fits (the message says what
    overflows and by how much)."""
    from glm5.config import GLM5Config
    from glm5.deploy.machines import Machine
    from glm5.deploy.plan import Request, make_plan
    from glm5.deploy.serve import to_json, to_text

    try:
        m = Machine.load(machine)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--machine") from exc
    try:
        cfg = (
            GLM5Config.from_json(config_name)
            if config_name.endswith(".json")
            else GLM5Config.from_preset(config_name)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
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
        p = make_plan(req)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    path = model_path or f"/models/GLM-5-{recipe}" + ("" if recipe == "bf16" else f"-{req.checkpoint_format}")
    if as_json:
        click.echo(json.dumps(to_json(p, path), indent=2))
    else:
        click.echo(to_text(p, path))
    if not p.fits:
        lay = p.layout
        why = lay.overflow or "; ".join(lay.violations) or "no layout fits"
        more = f"; fits with --nodes {p.min_nodes} ({p.min_nodes_layout})" if p.min_nodes else ""
        click.echo(f"error: {recipe} does not fit {nodes} x {m.name} ({lay.name()}): {why}{more}", err=True)
        sys.exit(1)
