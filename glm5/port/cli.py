"""`glm5 port`: start a backend for a new chip (`init`) and report how far it is from GLM-5 (`status`).

glm5 port init mychip --dir glm5-mychip
glm5 port status mychip --json status.json --markdown status.md
"""

from __future__ import annotations

import sys

import click


@click.group()
def port() -> None:
    """Porting kit: a new backend package, and the porting report of a backend (docs/porting.md)."""


@port.command("init")
@click.argument("name")
@click.option("--dir", "directory", default=None, help="Where to write the package (default ./glm5-NAME).")
@click.option("--force", is_flag=True, help="Write into DIR even if it exists and is not empty.")
def init_cmd(name: str, directory: str | None, force: bool) -> None:
    """Write an installable backend package NAME whose every op declines with "not ported yet"."""
    from glm5.port.init import PortError, init

    try:
        root, written = init(name, directory, force)
    except PortError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:  # a name too long for the file system, a symlink loop, a read-only parent
        from glm5.cli import DISK_ERRNOS
        from glm5.infra.fsio import describe

        if exc.errno in DISK_ERRNOS:
            raise  # a full disk: glm5's one line, exit 1
        click.echo(f"error: --dir: {describe(exc)}", err=True)
        sys.exit(2)
    click.echo(f"wrote {len(written)} files to {root}")
    click.echo(f"next: pip install -e {root} && glm5 conformance --backend {name}  (steps: {root}/README.md)")


@port.command("status")
@click.argument("name")
@click.option(
    "--suite",
    type=click.Choice(["smoke", "quick", "full"]),
    default="quick",
    show_default=True,
    help="Conformance suite the report runs (as `glm5 conformance --suite`).",
)
@click.option(
    "--config", "config", default="tiny", show_default=True, help="Preset or config.json of the run."
)
@click.option(
    "--recipe",
    "recipes",
    multiple=True,
    help="Quantization recipe(s) of the run (quant/recipes), repeatable.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="Activation dtype of the run (default: float32 for tiny, bfloat16 otherwise).",
)
@click.option("--train", is_flag=True, help="Also the ops of a training step (loss and backward).")
@click.option("--no-model", is_flag=True, help="Skip the model-level checks (greedy tokens, shadow mode).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Write it as Markdown.")
@click.option(
    "--from-json",
    type=click.Path(dir_okay=False),
    help="Build the report from this `glm5 conformance --json` file instead of running the suite.",
)
@click.option(
    "--conformance-json",
    type=click.Path(dir_okay=False),
    help="Also write the conformance JSON of the same run (glm5 conformance --json).",
)
def status_cmd(
    name,
    suite,
    config,
    recipes,
    dtype,
    train,
    no_model,
    json_path,
    markdown_path,
    from_json,
    conformance_json,
):
    """Porting report of backend NAME: per op and dtype passing/failing/unsupported with the reason,
    determinism claims, model-level checks, and the ops still missing to run GLM-5 (--config, --recipe)."""
    import contextlib

    from rich.console import Console

    from backends.errors import BackendUnavailable
    from conformance.cli import check_outputs, lock_outputs
    from glm5.port import status as st
    from glm5.port.needs import NeedsError

    outputs = check_outputs(
        {"--json": json_path, "--markdown": markdown_path, "--conformance-json": conformance_json}
    )
    # a report piped to a file keeps its columns (rich would otherwise assume 80)
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 150)
    with contextlib.ExitStack() as locks:
        lock_outputs(outputs, locks)  # one writer per report, for the whole run
        try:
            need = st.Need(config, tuple(recipes), dtype, train)
            rep = st.build(
                name,
                suite,
                need,
                model_checks=not no_model,
                console=console,
                conformance_json=conformance_json,
                from_json=from_json,
            )
        except (BackendUnavailable, NeedsError, st.StatusError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        st.render(rep, console)
        if json_path:
            st.write_json(rep, json_path)
        if markdown_path:
            st.write_markdown(rep, markdown_path)
