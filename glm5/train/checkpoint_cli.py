"""`glm5 checkpoint export-hf SRC OUT` / `glm5 checkpoint import-hf SRC OUT`: a sharded training checkpoint
(torch.distributed.checkpoint, written by `glm5 train --nproc N`) to the Hugging Face safetensors
directory the rest of the project reads, and back. Neither overwrites OUT; one writer at a time."""

from __future__ import annotations

import os
from pathlib import Path

import click

from glm5.cli_args import one_line_errors
from glm5.infra import fsio
from glm5.infra.fsio import one_writer


def _source(value: str, sharded: bool) -> Path:
    from glm5.train.distributed.checkpoint import is_sharded

    path = Path(os.path.realpath(value))  # RUN/checkpoints/latest is a symlink
    if not path.is_dir():
        raise click.BadParameter(f"{value} is not a directory", param_hint="'SRC'")
    if not (path / "config.json").is_file():
        raise click.BadParameter(f"{value} holds no config.json: not a checkpoint", param_hint="'SRC'")
    if is_sharded(path) != sharded:
        want = (
            "a sharded (glm5 train --nproc N)" if sharded else "a Hugging Face (config.json + *.safetensors)"
        )
        raise click.BadParameter(f"{value} is not {want} checkpoint", param_hint="'SRC'")
    if not sharded:
        from quant.load import is_quantized

        with one_line_errors("'SRC'"):
            quantized = is_quantized(path)
        if quantized:  # training state is float: a quantized export is not one to train from
            raise click.BadParameter(
                f"{value} is a quantized checkpoint; expected a float (unquantized) one", param_hint="'SRC'"
            )
    return path


def _refuse_existing(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise click.BadParameter(f"{out} already exists; choose a new directory", param_hint="'OUT'")
    if not out.parent.is_dir():
        raise click.BadParameter(f"{out.parent} is not a directory", param_hint="'OUT'")


def _convert(src: Path, out_arg: str, fn) -> None:
    if not out_arg.strip():
        raise click.BadParameter("expected a directory path, got an empty string", param_hint="'OUT'")
    out = Path(out_arg)
    _refuse_existing(out)
    with one_writer(out, hint="'OUT'"):
        _refuse_existing(out)  # again under the lock: another writer may have published it since
        try:
            with one_line_errors("'SRC'"):
                fn(src, out)
        except OSError as exc:
            raise click.ClickException(f"{fsio.describe(exc)} (nothing was published)") from None
    click.echo(str(out))


@click.group()
def checkpoint() -> None:
    """Convert sharded training checkpoints (glm5 train --nproc N) to and from the Hugging Face layout."""


@checkpoint.command("export-hf")
@click.argument("src")
@click.argument("out")
def export_hf(src: str, out: str) -> None:
    """SRC (a sharded checkpoint, e.g. RUN/checkpoints/latest) as a Hugging Face directory OUT."""
    from glm5.train.distributed.checkpoint import export_hf as convert

    _convert(_source(src, sharded=True), out, convert)


@checkpoint.command("import-hf")
@click.argument("src")
@click.argument("out")
def import_hf(src: str, out: str) -> None:
    """The Hugging Face directory SRC as a sharded checkpoint OUT (glm5 train --nproc N --model OUT)."""
    from glm5.train.distributed.checkpoint import import_hf as convert

    _convert(_source(src, sharded=False), out, convert)
