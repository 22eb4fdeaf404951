"""`glm5 quantize SRC --recipe glm5-w4a8 --format compressed-tensors|modelslim --out DIR`."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import click

from quant import recipe as recipes
from quant.load import FORMATS


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--recipe", "recipe_name", default="glm5-w4a8", show_default=True,
              help=f"recipe name ({', '.join(recipes.available())}) or a YAML path")
@click.option("--format", "fmt", type=click.Choice(sorted(FORMATS)), required=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--group-size", type=int, default=None, help="override the int4 group size (0: per channel)")
@click.option("--calib-seqs", type=int, default=16, show_default=True,
              help="calibration sequences of stdlib .py bytes (0: data-free round-to-nearest)")
@click.option("--calib-len", type=int, default=128, show_default=True)
@click.option("--backend", default="reference", show_default=True, help="backend that runs calibration")
def quantize(src: Path, recipe_name: str, fmt: str, out: Path, group_size: int | None, calib_seqs: int,
             calib_len: int, backend: str) -> None:
    """Quantize the float checkpoint SRC by a recipe (layer-by-layer calibration) and write it as FORMAT."""
    import torch

    from glm5.model import GLM5ForCausalLM
    from quant.apply import quantize_model
    from quant.data import token_batch
    from quant.load import export

    try:
        recipe = recipes.Recipe.load(recipe_name, group_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--recipe") from exc
    if fmt == "modelslim" and any(r.scheme.group_size for r in recipe.rules):
        raise click.BadParameter("modelslim (vllm-ascend ascendv1) stores per-channel int4 only; this recipe "
                                 "uses per-group int4 (use --format compressed-tensors)",
                                 param_hint="--format")
    t0 = time.time()
    model = GLM5ForCausalLM.from_pretrained(src, backend=backend).eval()
    calib = token_batch("train", calib_seqs, calib_len, seed=0) if calib_seqs else None
    try:
        with torch.no_grad():
            plan = quantize_model(model, recipe, calib)
        export(model, out, fmt)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    counts = Counter(s.name if not s.group_size else f"{s.name}(g{s.group_size})" for s in plan.values())
    calib_note = f"{calib_seqs} x {calib_len} calibration tokens" if calib_seqs else "no calibration"
    click.echo(f"{recipe.name} -> {fmt} at {out}: {dict(sorted(counts.items()))} weights quantized, "
               f"{calib_note}, {time.time() - t0:.1f}s")
