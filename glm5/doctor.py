"""`glm5 doctor`: every known backend, whether it can run here, and why not."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table


@click.command()
def doctor() -> None:
    """List every backend (built-in and plugin) with its status and reason."""
    import backends

    table = Table(title="GLM-5 backends")
    for col in ("backend", "ok", "reason"):
        table.add_column(col)
    for name, ok, reason in backends.available():
        table.add_row(name, "[green]yes[/]" if ok else "[red]no[/]", escape(reason))
    Console().print(table)
