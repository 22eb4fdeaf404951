"""`glm5 doctor`: every known backend, whether it can run here, why not, and versions."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# environment() keys worth a glance; per-op provenance and call routes belong to conformance reports
_SHOWN = (
    "mode",
    "torch",
    "triton",
    "triton-ascend",
    "torch_npu",
    "cann",
    "onnxruntime",
    "onnx",
    "interpreter",
    "gpu",
    "device",
    "soc",
)


@click.command()
def doctor() -> None:
    """List every backend (built-in and plugin) with its status, reason and versions."""
    from backends import registry

    table = Table(title="GLM-5 backends")
    for col in ("backend", "ok", "reason", "versions"):
        table.add_column(col)
    for name, ok, reason in registry.available():
        versions = ""
        if name in registry.names():
            try:
                env = registry.loaded(name).environment() if registry.loaded(name) else {}
            except Exception as exc:  # a broken environment() is shown, not hidden
                env = {"environment()": f"{type(exc).__name__}: {exc}"}
            versions = ", ".join(f"{k}={env[k]}" for k in (*_SHOWN, "environment()") if k in env)
        table.add_row(name, "[green]yes[/]" if ok else "[red]no[/]", escape(reason), escape(versions))
    Console().print(table)
