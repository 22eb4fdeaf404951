"""The `glm5` command. Each subcommand lives with the code it drives and is imported lazily, so
`glm5 doctor` works even when an optional part (a backend, the model) fails to import."""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command
SUBCOMMANDS: dict[str, str] = {
    "doctor": "glm5.doctor:doctor",
    "conformance": "conformance.cli:conformance",
    "generate": "glm5.generate:generate_cmd",
    "quantize": "quant.cli:quantize",
    "export-onnx": "glm5.onnx_export.export:export_onnx",
    "train": "glm5.train.cli:train",
    "plan": "glm5.deploy.cli:plan",
    "port": "glm5.port.cli:port",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        mod, attr = SUBCOMMANDS[name].split(":")
        return getattr(importlib.import_module(mod), attr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """GLM-5 backend layer: conformance, model, training, quantization, deployment planning."""


if __name__ == "__main__":
    main()
