"""What every `glm5` command shares on its command line: one spelling of the checkpoint argument
(`--model DIR`; the old `--checkpoint`, `--init` and positional forms still work, hidden and
deprecated), checked before any heavy import, and bad input reported as one line with exit code 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

_ALIAS_KEY = "glm5.model_alias"


def _checked(value: str | Path | None, quantized: bool | None, sharded: bool = False) -> Path | None:
    """The checkpoint directory `value` (symlinks such as run/checkpoints/latest resolved) or BadParameter;
    a sharded training checkpoint only where `sharded` (elsewhere: how to convert it)."""
    if value is None:
        return None
    from glm5.core.checkpoint import check_dir

    try:
        path = check_dir(value)
        if not sharded and (path / "model").is_dir() and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"{path} is a sharded checkpoint of glm5 train --nproc N; convert it first: "
                f"glm5 checkpoint export-hf {path} HF_DIR, then pass HF_DIR"
            )
        if quantized is not None:
            from quant.load import is_quantized

            if is_quantized(path) != quantized:
                want = "a quantized" if quantized else "a float (unquantized)"
                got = "a quantized" if not quantized else "a float"
                raise ValueError(f"{path} is {got} checkpoint; expected {want} one")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def model_option(
    help: str = "Checkpoint directory (config.json + safetensors), e.g. RUN/checkpoints/latest.",
    required: bool = False,
    aliases: tuple[str, ...] = (),
    quantized: bool | None = None,
    sharded: bool = False,
) -> Callable:
    """`--model DIR` (parameter `model_path`), validated as a checkpoint; `aliases` (e.g. "--checkpoint")
    are hidden deprecated spellings of it. quantized=False/True also refuses the other kind; a sharded
    training checkpoint is refused unless `sharded`, saying how to convert it."""

    def remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            if ctx.meta.get(_ALIAS_KEY) is not None:
                raise click.UsageError(f"give the checkpoint once (--model), got {param.opts[0]} twice")
            click.echo(f"note: {param.opts[0]} is deprecated; use --model", err=True)
            ctx.meta[_ALIAS_KEY] = value

    def resolve(ctx: click.Context, param: click.Parameter, value: Any) -> Path | None:
        alias = ctx.meta.get(_ALIAS_KEY)
        if value is not None and alias is not None:
            raise click.UsageError("give the checkpoint once: --model, not also its deprecated spelling")
        value = value if value is not None else alias
        if value is None and required:
            raise click.MissingParameter(param=param, ctx=ctx)
        return _checked(value, quantized, sharded)

    def deco(f: Callable) -> Callable:
        f = click.option(
            "--model", "model_path", default=None, metavar="DIR", help=help, callback=resolve, is_eager=False
        )(f)
        for a in aliases:
            if a.startswith("--"):
                f = click.option(
                    a, expose_value=False, hidden=True, is_eager=True, callback=remember, metavar="DIR"
                )(f)
            else:
                f = click.argument(
                    a,
                    required=False,
                    expose_value=False,
                    is_eager=True,
                    callback=remember,
                    cls=_HiddenArgument,
                )(f)
        return f

    return deco


class _HiddenArgument(click.Argument):
    """A deprecated positional form: accepted, left out of the usage line."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


def check_preset(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: `value` must name a preset in glm5/core/presets/ (None passes)."""
    from glm5.core.config import PRESET_DIR

    if value is not None and not (PRESET_DIR / f"{value}.yaml").is_file():
        known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
        raise click.BadParameter(f"expected a preset ({known}), got {value!r}")
    return value


#: the model commands' (generate, train) backend when neither --backend nor $GLM5_BACKEND names one: the
#: fast CPU backend (issue 14); the library default (`backends.get()`) stays the reference, the oracle.
MODEL_DEFAULT_BACKEND = "cpu"


def backend_choice(value: str | None, hint: str = "'--backend'", default: str | None = None) -> Any:
    """The backend `value` (None: $GLM5_BACKEND, else `default`, else reference) as a usable Backend, or
    BadParameter naming the known backends, or why this one cannot run here."""
    import backends
    from backends.interface import validation_mode

    try:
        validation_mode()  # a bad GLM5_VALIDATE is its own error, not the backend's
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    env = os.environ.get("GLM5_BACKEND")
    if value is None and env:
        hint = "GLM5_BACKEND"
    try:
        return backends.get(value or env or default)
    except Exception as exc:  # BackendUnavailable, unknown name: the message says which and why
        known = ", ".join(n for n, _, _ in backends.available())
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "known" not in msg:
            msg += f" (known: {known})"
        raise click.BadParameter(msg, param_hint=hint) from None


@contextlib.contextmanager
def one_line_errors(hint: str | None = None) -> Iterator[None]:
    """ValueError / FileNotFoundError raised inside (a bad preset, a checkpoint that does not fit) become
    one line with exit code 2 (naming `hint` when given) instead of a traceback."""
    try:
        yield
    except click.ClickException:
        raise
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if hint:
            raise click.BadParameter(text, param_hint=hint) from None
        raise click.UsageError(text) from None


def available_memory_bytes() -> int | None:
    """Memory a new process can still allocate: MemAvailable (Linux /proc/meminfo), else the free physical
    pages (os.sysconf); None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_preset_fits(preset: str | None, hint: str, dtype: Any = None) -> None:
    """Refuse (BadParameter on `hint`) a preset whose parameters alone, at `dtype` (default: torch's default
    dtype), need more memory than is available, before anything is allocated: the model is counted on the
    meta device. None passes."""
    if preset is None:
        return
    import torch

    from glm5.core.config import GLM5Config
    from glm5.deploy.inventory import meta_model

    dtype = dtype or torch.get_default_dtype()
    params = meta_model(GLM5Config.from_preset(preset), dtype).parameter_counts()["total"]
    need, have = params * dtype.itemsize, available_memory_bytes()
    if have is not None and need > have:
        gib = 1 << 30
        raise click.BadParameter(
            f"{preset} has {params / 1e9:.1f} B parameters: {need / gib:.1f} GiB as {str(dtype)[6:]} "
            f"just to hold them, but {have / gib:.1f} GiB of memory is available here (use a smaller "
            "preset such as tiny; `glm5 plan` sizes the real deployment)",
            param_hint=hint,
        )


def check_positions(config: Any, used: int, hint: str, what: str) -> None:
    """Refuse (BadParameter on `hint`) `used` token positions (`what` they are, for the message) past the
    model's max_position_embeddings."""
    limit = config.max_position_embeddings
    if used > limit:
        raise click.BadParameter(
            f"{what}: {used} positions, more than this model's max_position_embeddings={limit}",
            param_hint=hint,
        )
