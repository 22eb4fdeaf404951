"""Streamed conversion: a float or GLM-5-FP8 checkpoint quantized (W8A8 / W4A8 by a recipe, or re-encoded
as block FP8) and written one decoder layer at a time, so the model never exists whole in memory.

The model is built on the meta device. Embeddings, final norm and head are read first (calibration needs
the embedding). Then, per decoder layer in order: its tensors are read (FP8 weights de-quantized block by
block as they are read, quant/formats/fp8.py), the layer is calibrated on the activations the quantized
layers before it produced (quant/calibrate.py, as `quantize_model` does on a whole model) or quantized
data-free, run once to make the next layer's input, written as one shard, and put back on the meta
device. Peak memory is the embeddings and head, one float layer and its quantized copy, and the
calibration activations: for GLM-5 one MoE layer (about 19 GB in bf16) instead of the 1.5 TB model.

The output is the same checkpoint, tensor for tensor, as `quantize_model` + `quant.load.export` on the
whole model (tests/quant/test_stream.py checks that bitwise). Names, shapes and leftovers are checked
against the model before any layer is read, so a wrong source fails at once, by tensor name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm5.core.checkpoint import (
    _DTYPES,
    FLOAT_DTYPES,
    CheckpointError,
    ShardWriter,
    check_shared_copy,
    hf_names,
    read_config,
    shared_copies,
    without_absent_mtp,
)
from glm5.infra.progress import Phases
from quant.apply import plan_model, quantize_modules
from quant.calibrate import begin, calibrate_layer
from quant.formats import compressed_tensors, fp8, modelslim
from quant.formats.common import TensorReader, within
from quant.recipe import Recipe, Scheme

WRITERS = {compressed_tensors.FORMAT: compressed_tensors, modelslim.FORMAT: modelslim, fp8.FORMAT: fp8}


def _outside_layers(name: str) -> bool:
    return not name.startswith("model.layers.")


class NotASource(ValueError):
    """`src` is not a float or GLM-5-FP8 checkpoint (already quantized, or an unknown quantization)."""


def open_source(src: Path, dtype: torch.dtype | None) -> tuple[TensorReader, dict[str, Any], torch.dtype]:
    """(reader, config.json, dtype) of a float or FP8 source; FP8 weights come out de-quantized."""
    from quant.load import detect_format

    raw = read_config(src)
    try:
        fmt = detect_format(src)
    except ValueError as exc:
        raise NotASource(str(exc)) from None
    if fmt not in (None, fp8.FORMAT):
        raise NotASource(f"{src} is already quantized ({fmt}); expected a float or FP8 checkpoint")
    stored = _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")))
    if fmt == fp8.FORMAT:
        fp8.check_config(raw.get("quantization_config") or {})
        dtype = dtype or (stored if stored in (torch.float32, torch.float16) else torch.bfloat16)
        return fp8.DequantizingReader(src, dtype), raw, dtype
    return TensorReader(src), raw, dtype or stored or torch.float32


@torch.no_grad()
def _materialize(
    model: nn.Module,
    modules: list[nn.Module],
    scope: Callable[[str], bool],
    reader: TensorReader,
    copies: dict[str, str],
) -> None:
    """Allocate `modules` on the backend's device and fill their tensors in `scope` from the reader."""
    for m in modules:
        m.to_empty(device=model.backend.device)
    params = model.state_dict(keep_vars=True)
    for hf, sd, e in hf_names(model):
        if scope(sd.rsplit(".", 1)[0]):
            (params[sd][e] if e is not None else params[sd]).copy_(reader.get(hf, FLOAT_DTYPES))
    for hf, sd in copies.items():
        if hf in reader and scope(hf.rsplit(".", 1)[0]):
            check_shared_copy(hf, reader.get(hf, FLOAT_DTYPES), sd, params[sd])


def _meta_layer(model: nn.Module, i: int, dtype: torch.dtype) -> nn.Module:
    from glm5.core.model import DecoderLayer, MTPLayer

    cfg = model.config
    with torch.device("meta"):
        return (MTPLayer if i >= cfg.num_hidden_layers else DecoderLayer)(cfg, i, dtype)


@torch.no_grad()
def convert(
    src: str | Path,
    out: str | Path,
    fmt: str,
    recipe: Recipe | None = None,
    calib_ids: torch.Tensor | None = None,
    backend: Any = None,
    dtype: torch.dtype | None = None,
    progress: Phases | None = None,
) -> dict[str, Scheme]:
    """Write `src` as `fmt` ('compressed-tensors' | 'modelslim': quantized by `recipe`, calibrated on
    calib_ids [B, S] or data-free; 'fp8': block FP8) to `out`, atomically, one layer in memory at a time.
    `progress` (glm5.infra.progress.Phases) shows each phase and layer. Returns the plan (empty for fp8)."""
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    if fmt not in WRITERS:
        raise ValueError(f"fmt: expected one of {sorted(WRITERS)}, got {fmt!r}")
    if fmt != fp8.FORMAT and recipe is None:
        raise ValueError(f"recipe: {fmt} needs a recipe")
    progress = progress or Phases("quantize", enabled=False)
    src = Path(src)
    progress.phase(f"loading {src}")
    reader, raw, dtype = open_source(src, dtype)
    config = without_absent_mtp(GLM5Config.from_dict(raw), reader.where, src)
    with torch.device("meta"):
        model = GLM5ForCausalLM(config, backend=backend, dtype=dtype)
    copies = {k: v for k, v in shared_copies(config).items() if k in reader}
    missing, unexpected, mismatched = reader.fit(model, copies)  # an FP8 source: its scales too
    if missing or unexpected or mismatched:
        raise CheckpointError(missing, unexpected, mismatched)
    plan = plan_model(model, recipe) if fmt != fp8.FORMAT else {}
    writer = WRITERS[fmt]
    if fmt == modelslim.FORMAT:
        writer.metadata(model, plan, set())  # refuses per-group int4 before any layer is read
    head = [model.model.embed_tokens, model.model.norm]
    head += [] if config.tie_word_embeddings else [model.lm_head]
    _materialize(model, head, _outside_layers, reader, copies)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    layers = model.model.layers
    n_main, total = config.num_hidden_layers, len(layers)
    x = step = topk = None
    if calib_ids is not None and plan:
        x, step = begin(model, calib_ids)
    what = "converting" if not plan else "calibrating" if x is not None else "quantizing"
    progress.phase(f"{what} layers", total=total)
    with ShardWriter(out) as w:
        for i in range(total):
            prefix = f"model.layers.{i}"
            _materialize(model, [layers[i]], within(prefix), reader, copies)
            names = {f"{prefix}.{n}" for n, _ in layers[i].named_modules() if n}
            if x is not None and i < n_main:
                if any(k.startswith(prefix + ".") for k in plan):
                    calibrate_layer(model, layers[i], prefix, x, step, topk, plan, recipe)
                x, topk = layers[i](x, step, topk)
            elif plan:
                quantize_modules(model, plan, recipe, names)
            w.add(writer.tensors(model, within(prefix)))
            layers[i] = _meta_layer(model, i, dtype)  # frees the layer
            reader.close()  # and unmaps the source pages it read
            progress.advance(1, f"(layer {i}{', MTP, data-free' if x is not None and i >= n_main else ''})")
        if plan:
            quantize_modules(model, plan, recipe, {n for n, _ in model.named_modules() if _outside_layers(n)})
        w.add(writer.tensors(model, _outside_layers))
        progress.phase(f"writing {fmt} to {out}")
        left = reader.unused()
        if left:
            raise CheckpointError([], left, [])
        w.finish(*writer.metadata(model, plan, w.names))
    return plan
