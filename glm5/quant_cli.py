"""`glm5 quantize --model SRC --recipe glm5-w4a8 --format compressed-tensors|modelslim --out DIR`."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import click

from glm5.cli_args import backend_choice, model_option, one_line_errors
from glm5.infra import fsio
from glm5.infra.fsio import one_writer
from quant import recipe as recipes
from quant.load import FORMATS

#: options that --format fp8 (a re-encoding, no recipe, no calibration) would otherwise silently ignore
_NOT_FOR_FP8 = ("recipe_name", "group_size", "calib_seqs", "calib_len")


def _refuse_unused_with_fp8() -> None:
    from click.core import ParameterSource

    ctx = click.get_current_context()
    for param in ctx.command.params:
        if param.name in _NOT_FOR_FP8 and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
            raise click.BadParameter(
                "--format fp8 re-encodes the source as block FP8 and takes no recipe nor calibration; drop "
                f"{param.opts[0]} (or choose --format compressed-tensors|modelslim)",
                param_hint=f"'{param.opts[0]}'",
            )


def _out_path(out: str) -> Path:
    """--out as a Path: an empty string (the current directory) or a path ending in '.' / '..' is
    refused, as the directory is replaced whole."""
    path = Path(out)
    if not out.strip() or path.name in ("", ".", ".."):
        raise click.BadParameter(f"expected a new directory's path, got {out!r}", param_hint="'--out'")
    return path


def _check_out(out: Path, src: Path, overwrite: bool) -> None:
    """Never write into or over the source, and replace an existing DIR only with --overwrite (and only
    when it is a checkpoint or empty: a directory of other files is never deleted). An --out that cannot
    be looked at (a name too long, no permission) is one line too."""
    try:
        _check_out_path(out, src, overwrite)
    except OSError as exc:
        raise click.BadParameter(fsio.describe(exc), param_hint="'--out'") from None


def _check_out_path(out: Path, src: Path, overwrite: bool) -> None:
    o, s = Path(os.path.realpath(out)), Path(os.path.realpath(src))
    if o == s or s in o.parents or o in s.parents:
        raise click.BadParameter(
            f"{out} overlaps the source checkpoint {src}; choose another directory", param_hint="'--out'"
        )
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise click.BadParameter(f"{out} exists and is not a directory", param_hint="'--out'")
        entries = list(out.iterdir())
        if entries and not overwrite:
            raise click.BadParameter(
                f"{out} already exists; pass --overwrite to replace it", param_hint="'--out'"
            )
        if entries and not (out / "config.json").is_file():
            raise click.BadParameter(
                f"{out} holds files but no checkpoint (no config.json): not replacing it",
                param_hint="'--out'",
            )


@click.command()
@model_option(
    help="Float or FP8 (GLM-5-FP8 style, de-quantized block by block) checkpoint directory.",
    required=True,
    aliases=("src",),
)
@click.option(
    "--recipe",
    "recipe_name",
    default="glm5-w4a8",
    show_default=True,
    help=f"recipe name ({', '.join(recipes.available())}) or a YAML path",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(sorted(FORMATS) + ["fp8"]),
    required=True,
    help="fp8: block FP8 as GLM-5-FP8 (the recipe and calibration do not apply)",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Directory to write (never the source; an existing one only with --overwrite).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint at --out (atomically).")
@click.option(
    "--group-size",
    type=click.IntRange(min=0),
    default=None,
    help="override the int4 group size (0: per channel)",
)
@click.option(
    "--calib-seqs",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="calibration sequences of stdlib .py bytes (0: data-free round-to-nearest)",
)
@click.option("--calib-len", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--backend", default="reference", show_default=True, help="backend that runs calibration")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def quantize(
    model_path: Path,
    recipe_name: str,
    fmt: str,
    out: str,
    overwrite: bool,
    group_size: int | None,
    calib_seqs: int,
    calib_len: int,
    backend: str,
    quiet: bool,
) -> None:
    """Quantize the float or FP8 checkpoint --model by a recipe (layer-by-layer calibration) and write it
    as FORMAT to --out, streaming: one decoder layer is in memory at a time, written as its own shard, and
    --out is replaced atomically at the end (an interrupted run leaves it as it was)."""
    src = model_path
    if fmt == "fp8":
        _refuse_unused_with_fp8()
    try:
        recipe = recipes.Recipe.load(recipe_name, group_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--recipe'") from exc
    if fmt == "modelslim" and any(r.scheme.group_size for r in recipe.rules):
        raise click.BadParameter(
            "modelslim (vllm-ascend ascendv1) stores per-channel int4 only; this recipe "
            "uses per-group int4 (use --format compressed-tensors)",
            param_hint="'--format'",
        )
    out = _out_path(out)
    _check_out(out, src, overwrite)  # before the lock file is made beside --out
    be = backend_choice(backend)

    from glm5.core.checkpoint import CheckpointError, NotACheckpoint
    from glm5.infra.progress import Phases
    from quant.data import token_batch
    from quant.stream import NotASource, convert

    with one_writer(out):
        fsio.recover(out.parent)  # an --out a killed --overwrite had set aside is put back, then checked
        _check_out(out, src, overwrite)
        t0 = time.time()
        calib = token_batch("train", calib_seqs, calib_len, seed=0) if calib_seqs and fmt != "fp8" else None
        with Phases("quantize", enabled=not quiet) as progress, one_line_errors():
            try:
                plan = convert(src, out, fmt, None if fmt == "fp8" else recipe, calib, be, progress=progress)
            except (CheckpointError, NotACheckpoint, NotASource) as exc:  # the source, not the options
                raise click.BadParameter(str(exc).splitlines()[0], param_hint="'--model'") from None
            except OSError as exc:  # a full disk: the staging is removed, --out is as it was
                if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                    raise  # a source file missing: one_line_errors' usage error
                raise click.ClickException(f"{fsio.describe(exc)} (nothing was published at {out})") from None
    if fmt == "fp8":
        click.echo(f"fp8 (e4m3, 128x128 blocks) at {out}, {time.time() - t0:.1f}s")
        return
    counts = Counter(s.name if not s.group_size else f"{s.name}(g{s.group_size})" for s in plan.values())
    calib_note = f"{calib_seqs} x {calib_len} calibration tokens" if calib_seqs else "no calibration"
    click.echo(
        f"{recipe.name} -> {fmt} at {out}: {dict(sorted(counts.items()))} weights quantized, "
        f"{calib_note}, {time.time() - t0:.1f}s, one layer in memory at a time"
    )
