"""The `glm5` command. Each subcommand lives with the code it drives and is imported lazily, so
`glm5 doctor` works even when an optional part (a backend, the model) fails to import."""

from __future__ import annotations

import errno
import importlib

import click

from glm5.threads import apply_command_threads

# name -> "module:attribute" of a click command
SUBCOMMANDS: dict[str, str] = {
    "doctor": "glm5.doctor:doctor",
    "conformance": "conformance.cli:conformance",
    "generate": "glm5.generate:generate_cmd",
    "quantize": "glm5.quant_cli:quantize",
    "export-onnx": "glm5.onnx_export.export:export_onnx",
    "train": "glm5.train.cli:train",
    "checkpoint": "glm5.train.checkpoint_cli:checkpoint",
    "plan": "glm5.deploy.cli:plan",
    "port": "glm5.port.cli:port",
    "ops": "glm5.port.ops:ops_cmd",
}


# one-line help shown by `glm5 --help` without importing the command (torch, onnx and triton imports
# took 11-21 s and failed without the optional extras); a command missing here is imported for its help
SUMMARIES: dict[str, str] = {
    "doctor": "List every backend (built-in and plugin) with its status, reason and versions.",
    "conformance": "Check backends against the CPU reference (docs/spec.md); report every backend.",
    "generate": "Generate token ids with GLM-5 (greedy or sampled; --mtp N for speculative decoding).",
    "quantize": "Quantize a float or FP8 checkpoint (W8A8/W4A8 recipe, or block FP8), one layer at a time.",
    "export-onnx": "Export the prefill graph (input_ids -> logits) with the glm5 ONNX functions.",
    "train": "Train GLM-5 (Muon Split, MTP, DSA stages, RL with IcePop); metrics and checkpoints in --out.",
    "plan": "Plan a deployment: which checkpoint, parallelism and memory fit the machines.",
    "checkpoint": "Convert a sharded training checkpoint to the Hugging Face layout (export-hf) and back.",
    "ops": "Where an op lives: spec section, reference, each backend's file and kernel, cases, tests, bench.",
}

# a write that failed for want of room or permission on the disk: one line, not a traceback
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)

# the pip extra a command's imports need, for the one-line error when it is missing
EXTRAS: dict[str, str] = {"export-onnx": "onnx", "train": "train"}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def format_commands(self, ctx, formatter):
        rows = []
        for name in self.list_commands(ctx):
            text = SUMMARIES.get(name)
            if text is None:
                try:
                    text = self.get_command(ctx, name).get_short_help_str(limit=formatter.width)
                except click.ClickException as exc:
                    text = f"(unavailable: {exc.format_message()})"
            rows.append((name, text))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx):
        """A full (or read-only) disk in any command: one line naming the file, exit 1 (each command's writes
        are atomic, so nothing of the output was published)."""
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno not in (*DISK_ERRNOS, *ACCESS_ERRNOS):
                raise
            from glm5.infra.fsio import describe

            if exc.errno in ACCESS_ERRNOS:  # a source the user cannot read, an output they cannot write
                raise click.ClickException(describe(exc)) from None
            raise click.ClickException(f"{describe(exc)} (nothing of this output was published)") from None

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        mod, attr = SUBCOMMANDS[name].split(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except ImportError as exc:
            extra = EXTRAS.get(name)
            how = f"pip install 'glm5-backends[{extra}]'" if extra else "reinstall the package"
            raise click.UsageError(f"{name}: needs {exc.name or exc} ({how})") from None


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="glm5-backends", prog_name="glm5", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context) -> None:
    """GLM-5 backend layer: conformance, model, training, quantization, deployment planning."""
    apply_command_threads(ctx.invoked_subcommand)  # e.g. one intra-op thread for conformance


if __name__ == "__main__":
    main()
