"""`glm5 export-onnx`: the GLM-5 prefill graph (input_ids [B, S] -> logits [B, S, V]) as an ONNX model
whose DSA, routing and expert ops are calls to the `glm5` ONNX functions (docs/onnx.md).

The model is traced on its own backend by `torch.onnx.export(dynamo=True)`: every contract op is one
`torch.ops.glm5.<op>` custom-op node (backends/contract/library.py), which the translation table
(glm5/onnx_export/translation.py) maps to its glm5 function; the model then carries the function
definitions (model-local functions, checked by `onnx.checker`). Shapes are static (one B and S per
export: vendor compilers want them static, and the layout is built from them). `--inline` writes the
model with the functions inlined, for toolchains that do not accept them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click
import torch

from glm5.cli_args import (
    check_positions,
    check_preset,
    check_preset_fits,
    model_option,
    one_line_errors,
)
from glm5.infra import fsio
from glm5.infra.fsio import one_writer
from glm5.infra.progress import Phases

if TYPE_CHECKING:  # onnx is imported when the command runs, so that its --help works without the extra
    import onnx


def export_prefill(model, batch: int, seq_len: int) -> onnx.ModelProto:
    """ONNX model of `model`'s prefill (no KV cache): input `input_ids` int64 [batch, seq_len] ->
    `logits` [batch, seq_len, V] in the model's dtype."""
    from backends.onnxruntime.functions import DOMAIN, OPSET
    from glm5.onnx_export.program import trace_prefill
    from glm5.onnx_export.translation import attach_functions, translation_table

    program = torch.onnx.export(
        trace_prefill(model, batch, seq_len),
        input_names=["input_ids"],
        output_names=["logits"],
        opset_version=OPSET,
        custom_translation_table=translation_table(),
        optimize=False,
        verbose=False,
    )
    proto = program.model_proto
    proto.producer_name = "glm5-backends export-onnx"
    proto.doc_string = (
        f"GLM-5 prefill: input_ids int64 [{batch}, {seq_len}] -> logits [{batch}, {seq_len}, V]; "
        f"DSA/MoE ops are {DOMAIN} functions (docs/onnx.md)"
    )
    attach_functions(proto)
    return proto


def run_onnx(proto: onnx.ModelProto, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of `proto` in ONNX Runtime (CPU EP) for input_ids [B, S]."""
    import onnxruntime as ort

    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(["logits"], {"input_ids": input_ids.numpy()})[0])


@contextlib.contextmanager
def _exporter_warnings(quiet: bool) -> Iterator[None]:
    """Under --quiet, the exporters' warnings (torch.onnx's registry, onnx_ir's attribute types, torch's
    FutureWarnings) are silenced; their errors still show."""
    if not quiet:
        yield
        return
    was = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(was)


def _refuse_fp8(path: Path) -> None:
    from backends.onnxruntime.functions import OPSET
    from glm5.core.checkpoint import read_config

    qc = read_config(path).get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        raise click.BadParameter(
            f"{path} is an FP8 checkpoint: the glm5 ONNX functions have no e4m3 ops (opset {OPSET}); convert "
            "it first (glm5 quantize --model DIR --recipe glm5-w8a8 --format compressed-tensors --out DIR2)",
            param_hint="'--model'",
        )


def _load(preset: str | None, checkpoint: str | None, dtype: torch.dtype):
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from glm5.loader import load_model

    if checkpoint:
        return load_model(checkpoint, backend="reference", dtype=dtype)
    return GLM5ForCausalLM(GLM5Config.from_preset(preset or "tiny"), backend="reference", dtype=dtype)


@click.command("export-onnx")
@click.option(
    "--preset",
    default=None,
    callback=check_preset,
    help="Model preset (default: tiny) when no --model is given.",
)
@model_option(
    help="A float or W8A8 / W4A8 (compressed-tensors, msModelSlim) checkpoint directory.",
    aliases=("--checkpoint",),
)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=64, show_default=True)
# float32 only: torch exports the absorbed-MLA einsums as ONNX Einsum, which has no bfloat16 in opset 18;
# vendor compilers choose their own precision (ATC precision modes) from the float32 graph
@click.option("--dtype", type=click.Choice(["float32"]), default="float32", show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    required=True,
    help="Where to write the .onnx model (an existing file only with --overwrite).",
)
@click.option("--overwrite", is_flag=True, help="Replace existing output files (atomically).")
@click.option(
    "--inline", is_flag=True, help="Also write <out>.inlined.onnx with every glm5 function inlined."
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Run the model in ONNX Runtime and compare its logits with the reference backend's.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the verification input ids.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def export_onnx(
    preset, model_path, batch, seq_len, dtype, out, overwrite, inline, verify, seed, quiet
) -> None:
    """Export the prefill graph (input_ids -> logits) with the glm5 ONNX functions."""
    try:
        import onnx
        import onnx.inliner
        import onnxscript  # noqa: F401  (the glm5 functions are onnxscript)
    except ImportError as exc:
        raise click.UsageError(
            f"export-onnx: needs {exc.name or exc} (pip install 'glm5-backends[onnx]')"
        ) from None
    from backends.onnxruntime.functions import DOMAIN, OPSET

    if preset is not None and model_path is not None:
        raise click.UsageError("give at most one of --model or --preset")
    inlined = str(Path(out).with_suffix("")) + ".inlined.onnx"
    outputs = [out] + ([inlined] if inline else [])

    def refuse_existing() -> None:
        for path in outputs:
            if Path(path).exists() and not overwrite:
                raise click.BadParameter(
                    f"{path} already exists; pass --overwrite to replace it", param_hint="'--out'"
                )

    refuse_existing()
    for path in outputs:
        if not Path(path).parent.is_dir():
            raise click.BadParameter(f"{Path(path).parent} is not a directory", param_hint="'--out'")
    if model_path is not None:
        _refuse_fp8(model_path)
    if model_path is None:
        check_preset_fits(preset or "tiny", "'--preset'", getattr(torch, dtype))
    # one writer of --out at a time (its lock, .NAME.lock beside it, covers the inlined file too)
    with one_writer(out), Phases("export-onnx", enabled=not quiet) as progress, _exporter_warnings(quiet):
        refuse_existing()  # again under the lock: another writer may have published it since
        progress.phase(f"loading {model_path or preset or 'tiny'}")
        with one_line_errors("'--model'"):
            model = _load(preset, model_path, getattr(torch, dtype))
        check_positions(model.config, seq_len, "'--seq-len'", "the prefill")
        progress.phase(f"exporting the prefill graph (batch {batch}, seq-len {seq_len})")
        proto = export_prefill(model, batch, seq_len)
        progress.phase(f"writing {out}")
        fsio.write_file_atomically(Path(out), lambda tmp: onnx.save(proto, str(tmp)))
        n_fn = len(proto.functions)
        click.echo(f"wrote {out}: opset {OPSET}, {len(proto.graph.node)} nodes, {n_fn} {DOMAIN} functions")
        if inline:
            progress.phase("inlining the glm5 functions")
            flat = onnx.inliner.inline_local_functions(proto)
            onnx.checker.check_model(flat, full_check=True)
            fsio.write_file_atomically(Path(inlined), lambda tmp: onnx.save(flat, str(tmp)))
            click.echo(f"wrote {inlined}: {len(flat.graph.node)} nodes, no functions")
        if not verify:
            return
        progress.phase("verifying: ONNX Runtime vs the reference backend")
        ids = torch.randint(
            0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)
        )
        got = run_onnx(proto, ids)
        with torch.no_grad():
            want = model(ids).logits
        err = (got.float() - want.float()).abs().max().item()
        try:
            torch.testing.assert_close(got, want)
        except AssertionError as exc:
            raise click.ClickException(f"ONNX Runtime logits differ from the reference: {exc}") from exc
        click.echo(f"verified: ONNX Runtime logits match the reference backend (max abs diff {err:.3g})")
