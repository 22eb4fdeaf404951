"""msModelSlim "ascendv1" checkpoints (what vllm-ascend loads with `--quantization ascend`).

quant_model_description.json maps every tensor to W8A8_DYNAMIC / W4A8_DYNAMIC / FLOAT, plus "version"
"1.0.0", "model_quant_type", "group_size" (0: per channel) and "optional". Tensors per linear [N, K]:
  W8A8_DYNAMIC: weight int8 [N, K], weight_scale fp32 [N, 1], weight_offset fp32 zeros [N, 1]
  W4A8_DYNAMIC: weight int8 [N/2, K], two's-complement int4 packed along the OUTPUT dim: byte (j, k) =
                (W[2j+1, k] << 4) | (W[2j, k] & 0xF); weight_scale / weight_offset as above; scale_bias fp32
                = 8 * sum_k W[n, k] * weight_scale[n], [N, 1], or [N, 16] (one sum per K/16 slice, for
                tensor parallelism up to 16) for down_proj / o_proj.
vllm-ascend's v1 W4A8 path is per channel only (its MoE method rejects group_size > 0): per-group int4
is refused here with that reason rather than written in the legacy two-level v0 layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.formats import pack_int4, unpack_int4
from glm5.core.checkpoint import FLOAT_DTYPES, config_json, read_json
from glm5.core.marks import MODELSLIM_DESCRIPTION
from quant.apply import tensor_schemes
from quant.formats.common import Scope, TensorReader, float_tensors, quantized_modules, write_checkpoint
from quant.recipe import FLOAT, W4A8, W8A8, Scheme

FORMAT = "modelslim"
DESCRIPTION = MODELSLIM_DESCRIPTION  # what the float reader refuses (glm5.core.marks)
_SLICED = ("down_proj", "o_proj", "w2")  # row-parallel projections: scale_bias per K/16 slice


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [-8, 7], N even -> int8 [N/2, K]: even row in the low nibble, odd row in the high."""
    if q.shape[0] % 2:
        raise ValueError(
            f"q: expected an even number of output rows to pack along N, got shape {list(q.shape)}"
        )
    return pack_int4(q.T.contiguous()).T.contiguous().view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N/2, K] -> int8 [N, K]; inverse of pack_int4_rows."""
    return unpack_int4(packed.view(torch.uint8).T.contiguous()).T.contiguous()


def scale_bias(q: torch.Tensor, scale: torch.Tensor, sliced: bool | int) -> torch.Tensor:
    """8 * sum_k q[n, k] * scale[n] as fp32 [N, 1], or [N, 16] summed per K/16 slice (an int: that many
    slices, e.g. a rank's share of the 16)."""
    n, k = q.shape
    slices = 16 if sliced is True else int(sliced) or 1
    if k % slices:
        raise ValueError(f"q: scale_bias per K/{slices} slice needs K divisible by {slices}, got K={k}")
    parts = q.to(torch.int64).reshape(n, slices, -1).sum(-1)  # exact integer sums
    return (8.0 * parts.float() * scale.reshape(n, 1).float()).contiguous()


def tensors(model: nn.Module, scope: Scope = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the modules in `scope` (all by default)."""
    out = float_tensors(model, scope)
    for name, scheme, get, *_ in quantized_modules(model, scope):
        q, scale, bias = get()
        if scheme.group_size:
            raise ValueError(
                f"format: modelslim (vllm-ascend v1) W4A8 is per channel only; {name} has "
                f"group_size {scheme.group_size} (use --format compressed-tensors)"
            )
        n = q.shape[0]
        out[f"{name}.weight_scale"] = scale.float().reshape(n, 1).clone()
        out[f"{name}.weight_offset"] = torch.zeros(n, 1)
        if scheme.name == W4A8:
            out[f"{name}.weight"] = pack_int4_rows(q)
            out[f"{name}.scale_bias"] = scale_bias(q, scale, name.rsplit(".", 1)[1] in _SLICED)
        else:
            out[f"{name}.weight"] = q.to(torch.int8).clone()
        if bias is not None:
            out[f"{name}.bias"] = bias.float().clone()
    return out


def metadata(model: nn.Module, plan: dict[str, Scheme], names: set[str]) -> tuple[dict, dict]:
    """(config.json, {quant_model_description.json: ...}) for the tensors `names` written from `model`
    quantized by `plan`: a tensor is its module's scheme, FLOAT when the module is not in the plan."""
    for name, scheme in plan.items():
        if scheme.group_size:
            raise ValueError(
                f"format: modelslim (vllm-ascend v1) W4A8 is per channel only; {name} has "
                f"group_size {scheme.group_size} (use --format compressed-tensors)"
            )
    desc = {}
    for t in sorted(names):
        s = plan.get(t.rsplit(".", 1)[0])
        desc[t] = s.name if s is not None else FLOAT
    kinds = {s.name for s in plan.values()}
    cfg = config_json(model)
    head = {
        "model_quant_type": W4A8 if W4A8 in kinds else (W8A8 if kinds else FLOAT),
        "version": "1.0.0",
        "group_size": 0,
        "optional": {},
    }
    return cfg, {DESCRIPTION: {**head, **desc}}


def export(model: nn.Module, path: Path) -> None:
    out = tensors(model)
    cfg, extra = metadata(model, {n: s for n, s, *_ in quantized_modules(model)}, set(out))
    write_checkpoint(path, cfg, out, extra)


def read_plan(path: Path, model: nn.Module) -> dict[str, Scheme]:
    desc = read_json(Path(path), DESCRIPTION)
    if not isinstance(desc, dict):
        raise ValueError(f"{DESCRIPTION}: expected a JSON object, got {type(desc).__name__}")
    if str(desc.get("version", "1.0.0")) != "1.0.0":
        raise ValueError(f"{DESCRIPTION}: version expected '1.0.0' (ascendv1), got {desc.get('version')!r}")
    if int(desc.get("group_size", 0) or 0):
        raise ValueError(f"{DESCRIPTION}: group_size expected 0 (per channel), got {desc.get('group_size')}")
    plan: dict[str, Scheme] = {}
    float_names = tensor_schemes(model, {})
    for t in float_names:
        kind = desc.get(t)
        if kind is None:
            raise ValueError(f"{DESCRIPTION}: tensor {t} of the model is not described")
        if kind in (W8A8, W4A8):
            if not t.endswith(".weight"):
                raise ValueError(f"{DESCRIPTION}: {t} is {kind}, but only linear weights are quantized")
            plan[t.removesuffix(".weight")] = Scheme(kind)
        elif kind != FLOAT:
            raise ValueError(
                f"{DESCRIPTION}: {t} expected W8A8_DYNAMIC, W4A8_DYNAMIC or FLOAT, got {kind!r} "
                "(static W8A8 is not supported)"
            )
    return plan


def decode(name: str, scheme: Scheme, reader: TensorReader) -> tuple[torch.Tensor, torch.Tensor, Any]:
    w = reader.get(f"{name}.weight")
    if w.dtype != torch.int8:
        raise ValueError(f"checkpoint: {name}.weight expected int8, got {w.dtype}")
    q = unpack_int4_rows(w) if scheme.name == W4A8 else w
    scale = reader.get(f"{name}.weight_scale", FLOAT_DTYPES).float()
    if scale.numel() != q.shape[0] or scale.dim() > 2:
        raise ValueError(
            f"checkpoint: {name}.weight_scale expected shape [{q.shape[0]}, 1], got {list(scale.shape)}"
        )
    scale = scale.reshape(q.shape[0], 1)
    off = reader.get(f"{name}.weight_offset")
    if bool(off.ne(0).any()):
        raise ValueError(f"checkpoint: {name}.weight_offset is nonzero; only symmetric weights are supported")
    if scheme.name == W4A8:
        sb = reader.get(f"{name}.scale_bias")  # None: a rank's column slice of sums over all K (band)
        slices = 0 if sb is None or sb.dim() != 2 or q.shape[1] % sb.shape[1] else sb.shape[1]
        want = scale_bias(q, scale, slices) if slices else None
        # a wrong nibble order or packing axis changes these sums: refuse rather than load garbage
        if sb is not None and (
            want is None
            or sb.shape != want.shape
            or not torch.allclose(sb.float(), want, rtol=1e-5, atol=1e-6)
        ):
            raise ValueError(
                f"checkpoint: {name}.scale_bias does not match 8 * sum_k W * weight_scale "
                "of the unpacked weight (packing order or axis differs from msModelSlim "
                "ascendv1)"
            )
    bias = reader.get(f"{name}.bias", FLOAT_DTYPES) if f"{name}.bias" in reader else None
    return q, scale, bias


def band_units(scheme: Scheme) -> tuple[int, int]:
    """(rows, columns) of the [N, K] weight a slice of the stored tensors must come in: int4 packs two
    output rows per byte."""
    return (2, 1) if scheme.name == W4A8 else (1, 1)


def band(
    suffix: str, t: torch.Tensor, scheme: Scheme, rows: slice, cols: slice, full: tuple[int, int]
) -> torch.Tensor | None:
    """The part of stored tensor `<linear>.<suffix>` that holds rows x cols (whole `band_units`) of the
    linear's [N, K] weight, sliced before anything is read; decode() reads the parts as a checkpoint of
    that block. A per-slice `scale_bias` keeps the slices of the columns; one that sums over more columns
    than the block's cannot be checked there: None (another rank's rows check the packing)."""
    n, k = full
    if suffix == "weight":  # int4: two output rows per byte
        return t[rows.start // 2 : -(-rows.stop // 2), cols] if scheme.name == W4A8 else t[rows, cols]
    if suffix == "scale_bias" and (cols.start, cols.stop) != (0, k):
        w = k // t.shape[-1]
        if t.shape[-1] == 1 or cols.start % w or cols.stop % w:
            return None
        return t[rows, cols.start // w : cols.stop // w]
    return t[rows]
