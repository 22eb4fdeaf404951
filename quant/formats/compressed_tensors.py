"""compressed-tensors checkpoints (what vLLM loads on CUDA).

config.json carries `quantization_config` (quant_method "compressed-tensors"): one config group per scheme
with regex targets over module names, an `ignore` list, per-group `format`. Tensors per linear:
  W8A8 ("int-quantized"):  weight int8 [N, K], weight_scale fp32 [N, 1]
  W4A8 ("pack-quantized"): weight_packed int32 [N, ceil(K/8)], weight_scale fp32 [N, G],
                           weight_shape int64 [2]
pack-quantized stores w + 8 (unsigned nibbles), eight per int32 along K, element i at bits 4i, padding
with raw 0 (compressed_tensors pack_to_int32). Scales are written fp32 so a reload is bit-identical.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.formats import pack_int4, unpack_int4
from glm5.core.checkpoint import FLOAT_DTYPES, config_json, read_config
from quant.apply import quantizable
from quant.formats.common import Scope, TensorReader, float_tensors, quantized_modules, write_checkpoint
from quant.recipe import W4A8, W8A8, Scheme

FORMAT = "compressed-tensors"
_ACT = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
    "group_size": None,
    "block_structure": None,
    "actorder": None,
    "observer": None,
    "observer_kwargs": {},
}


def pack_int4_int32(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [-8, 7] -> int32 [N, ceil(K/8)]: nibble (q + 8) of element i at bits 4i."""
    n, k = q.shape
    pad = (-k) % 8
    q = torch.cat([q.to(torch.int8), torch.full((n, pad), -8, dtype=torch.int8)], dim=1)  # raw 0 after +8
    b = (pack_int4(q) ^ 0x88).to(torch.int64).reshape(n, -1, 4)  # bytes of (q + 8) nibbles, 2 per byte
    v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def unpack_int4_int32(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> int8 [N, K] in [-8, 7]; inverse of pack_int4_int32."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(v >> (8 * j)) & 0xFF for j in range(4)], dim=-1).reshape(packed.shape[0], -1)
    return unpack_int4(b.to(torch.uint8) ^ 0x88)[:, :k]


def _weights_args(s: Scheme) -> dict[str, Any]:
    return {
        "num_bits": s.bits,
        "type": "int",
        "symmetric": True,
        "dynamic": False,
        "strategy": "group" if s.group_size else "channel",
        "group_size": s.group_size or None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def _template(name: str) -> str:
    return "re:^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


def _quantization_config(model: nn.Module, schemes: dict[str, Scheme]) -> dict[str, Any]:
    groups: dict[Scheme, set[str]] = {}
    for n, s in schemes.items():
        groups.setdefault(s, set()).add(_template(n))
    targets = {t: s for s, ts in groups.items() for t in ts}
    ignore = ["lm_head"]
    for n, *_ in quantizable(model):
        if n not in schemes and n != "lm_head" and _template(n) in targets:
            ignore.append(n)  # e.g. the MTP layer's attention: same template, kept float
    config_groups = {}
    for i, (s, ts) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0].bits, kv[0].group_size))):
        config_groups[f"group_{i}"] = {
            "targets": sorted(ts),
            "weights": _weights_args(s),
            "input_activations": dict(_ACT),
            "output_activations": None,
            "format": "pack-quantized" if s.name == W4A8 else "int-quantized",
        }
    formats = {g["format"] for g in config_groups.values()}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def tensors(model: nn.Module, scope: Scope = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the modules in `scope` (all by default)."""
    out = float_tensors(model, scope)
    for name, scheme, get, *_ in quantized_modules(model, scope):
        q, scale, bias = get()
        if scheme.name == W4A8:
            out[f"{name}.weight_packed"] = pack_int4_int32(q)
            out[f"{name}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        else:
            out[f"{name}.weight"] = q.to(torch.int8).clone()
        out[f"{name}.weight_scale"] = scale.float().reshape(q.shape[0], -1).clone()
        if bias is not None:
            out[f"{name}.bias"] = bias.clone()
    return out


def metadata(model: nn.Module, plan: dict[str, Scheme], names: set[str]) -> tuple[dict, dict]:
    """(config.json additions, extra files) for a checkpoint of `model` quantized by `plan`; `model` may be
    the float model on the meta device (a streamed conversion), `names` the tensors written."""
    cfg = config_json(model)
    cfg["quantization_config"] = _quantization_config(model, plan)
    return cfg, {}


def export(model: nn.Module, path: Path) -> None:
    out = tensors(model)
    cfg, extra = metadata(model, {n: s for n, s, *_ in quantized_modules(model)}, set(out))
    write_checkpoint(path, cfg, out, extra)


def _scheme_of_group(g: dict[str, Any], key: str) -> Scheme:
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    if not (
        a.get("num_bits") == 8
        and a.get("type", "int") == "int"
        and a.get("strategy") == "token"
        and a.get("dynamic")
        and a.get("symmetric", True)
    ):
        raise ValueError(
            f"quantization_config.config_groups.{key}.input_activations: expected dynamic "
            f"symmetric per-token int8, got {a}"
        )
    if not w.get("symmetric", True) or w.get("type", "int") != "int":
        raise ValueError(f"quantization_config.config_groups.{key}.weights: expected symmetric int, got {w}")
    if w.get("num_bits") == 8 and w.get("strategy") == "channel":
        return Scheme(W8A8)
    if w.get("num_bits") == 4 and w.get("strategy") in ("channel", "group"):
        return Scheme(W4A8, int(w.get("group_size") or 0) if w.get("strategy") == "group" else 0)
    raise ValueError(
        f"quantization_config.config_groups.{key}.weights: expected int8 per-channel or int4 "
        f"per-channel / per-group, got {w}"
    )


def _matches(name: str, target: str) -> bool:
    return bool(re.match(target[3:], name)) if target.startswith("re:") else name == target


def read_plan(path: Path, model: nn.Module) -> dict[str, Scheme]:
    qc = read_config(Path(path)).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method: expected 'compressed-tensors', got {qc.get('quant_method')!r}"
        )
    groups = [
        (key, _scheme_of_group(g, key), g.get("targets") or [])
        for key, g in qc.get("config_groups", {}).items()
    ]
    ignore = qc.get("ignore") or []
    plan: dict[str, Scheme] = {}
    for name, *_ in quantizable(model):
        if any(_matches(name, t) for t in ignore):
            continue
        hits = [(k, s) for k, s, ts in groups if any(_matches(name, t) for t in ts)]
        if len(hits) > 1:
            raise ValueError(f"quantization_config: module {name} matches groups {[k for k, _ in hits]}")
        if hits:
            plan[name] = hits[0][1]
    return plan


def decode(name: str, scheme: Scheme, reader: TensorReader) -> tuple[torch.Tensor, torch.Tensor, Any]:
    if scheme.name == W4A8:
        n, k = (int(v) for v in reader.get(f"{name}.weight_shape").tolist())
        q = unpack_int4_int32(reader.get(f"{name}.weight_packed"), k)
        if q.shape[0] != n:
            raise ValueError(f"checkpoint: {name}.weight_packed has {q.shape[0]} rows, weight_shape says {n}")
    else:
        q = reader.get(f"{name}.weight")
        if q.dtype != torch.int8:
            raise ValueError(f"checkpoint: {name}.weight expected int8, got {q.dtype}")
    scale = reader.get(f"{name}.weight_scale", FLOAT_DTYPES).float()
    if scale.dim() != 2 or scale.shape[0] != q.shape[0]:
        raise ValueError(
            f"checkpoint: {name}.weight_scale expected shape [{q.shape[0]}, groups], got {list(scale.shape)}"
        )
    bias = reader.get(f"{name}.bias", FLOAT_DTYPES) if f"{name}.bias" in reader else None
    return q, scale, bias


def band_units(scheme: Scheme) -> tuple[int, int]:
    """(rows, columns) of the [N, K] weight a slice of the stored tensors must come in: int4 packs eight
    columns per int32 and a per-group scale covers group_size columns."""
    return (1, math.lcm(8, scheme.group_size or 1)) if scheme.name == W4A8 else (1, 1)


def band(
    suffix: str, t: torch.Tensor, scheme: Scheme, rows: slice, cols: slice, full: tuple[int, int]
) -> torch.Tensor:
    """The part of stored tensor `<linear>.<suffix>` that holds rows x cols (whole `band_units`) of the
    linear's [N, K] weight, sliced before anything is read; decode() reads the parts as a checkpoint of
    that [rows, cols] block (`weight_shape` becomes the block's)."""
    n, k = full
    if suffix == "weight_shape":
        if [int(v) for v in t.tolist()] != [n, k]:
            raise ValueError(f"checkpoint: weight_shape {t.tolist()} expected [{n}, {k}]")
        return torch.tensor([rows.stop - rows.start, cols.stop - cols.start], dtype=torch.int64)
    if suffix == "weight_packed":
        return t[rows, cols.start // 8 : -(-cols.stop // 8)]
    if suffix == "weight_scale" and t.dim() == 2 and t.shape[1] > 1:  # per group: its columns' groups
        gs = k // t.shape[1]
        return t[rows, cols.start // gs : cols.stop // gs]
    return t[rows, cols] if suffix == "weight" else t[rows]
