"""Quantized GLM-5 tensors through vLLM's weight iterator, each rank reading only its slice.

W8A8 / W4A8 in compressed-tensors or msModelSlim format and GLM-5-FP8: every quantized linear (or routed
expert projection) is stored as a few tensors (`weight` / `weight_packed`, its scales, ...). As each one
streams by, the rank slices the block of the linear's [N, K] weight the parallel plan gives it (rows for a
head / column-parallel split, columns for a row-parallel one, whole experts under expert parallel),
widened to the format's packing units (`band_units`: int4 pairs, int32 groups of eight, 128-blocks), and
copies only that block out of the (memory-mapped) tensor. Once a linear's tensors have all come, the
format's own `decode` reads the blocks as a checkpoint of that small linear, the result is trimmed to the
rank's exact part and set into the local module. The model is built from the checkpoint's quantization
config before any tensor streams (`quant.load.skeleton`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from backends.formats import BLOCK, E4M3
from glm5.core.checkpoint import FLOAT_DTYPES, CheckpointError, checked_tensor
from quant.formats import compressed_tensors, fp8, modelslim
from quant.formats.common import quantized_modules
from quant.fp8_modules import EXPERT_PROJS, FP8Experts
from quant.recipe import W4A8

FORMATS: dict[str, ModuleType] = {m.FORMAT: m for m in (compressed_tensors, modelslim, fp8)}
#: the tensors each quantized linear stores, by (format, scheme name); "bias" joins when it has one
STORED: dict[tuple[str, str | None], tuple[str, ...]] = {
    (compressed_tensors.FORMAT, "W8A8_DYNAMIC"): ("weight", "weight_scale"),
    (compressed_tensors.FORMAT, W4A8): ("weight_packed", "weight_shape", "weight_scale"),
    (modelslim.FORMAT, "W8A8_DYNAMIC"): ("weight", "weight_scale", "weight_offset"),
    (modelslim.FORMAT, W4A8): ("weight", "weight_scale", "weight_offset", "scale_bias"),
    (fp8.FORMAT, None): ("weight", f"weight{fp8.SCALE_SUFFIX}"),
}
SKIP = -1  # an expert another rank holds


@dataclass(frozen=True)
class Target:
    """One quantized linear of the unsplit model under its checkpoint name: its module, expert index and
    projection (routed experts), full [N, K], scheme (None: FP8), and whether it is de-quantized at load
    into a float parameter (GLM-5-FP8's kv_b_proj)."""

    module: str
    expert: int | None
    proj: str | None
    full: tuple[int, int]
    scheme: Any
    stored: tuple[str, ...]
    dequant: bool = False


def targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint base name -> Target of every quantized linear of the unsplit skeleton."""
    fmt = model.quant_format
    out: dict[str, Target] = {}
    if fmt != fp8.FORMAT:
        for name, scheme, _, mod, e in quantized_modules(model):
            stored = STORED[fmt, scheme.name]
            if e is None:
                full = (mod.out_features, mod.in_features)
                out[name] = Target(
                    name, None, None, full, scheme, stored + ("bias",) * (mod.bias is not None)
                )
            else:
                module, proj = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
                full = (mod.hidden, mod.inter) if proj == "down_proj" else (mod.inter, mod.hidden)
                out[name] = Target(module, e, proj, full, scheme, stored)
        return out
    stored = STORED[fmt, None]
    for name, mod in fp8.fp8_targets(model):
        if isinstance(mod, FP8Experts):
            for e in range(mod.n_experts):
                for p in EXPERT_PROJS:
                    full = (mod.hidden, mod.inter) if p == "down_proj" else (mod.inter, mod.hidden)
                    out[f"{name}.{e}.{p}"] = Target(name, e, p, full, None, stored)
        else:
            bias = ("bias",) * (mod.bias is not None)
            dequant = isinstance(mod, nn.Linear)  # not swapped for an FP8Linear: fp8.DEQUANT_AT_LOAD
            full = (mod.out_features, mod.in_features)
            out[name] = Target(name, None, None, full, None, stored + (() if dequant else bias), dequant)
    return out


def stored_shapes(fmt: str, suffix: str, scheme: Any, full: tuple[int, int]) -> list[tuple[int, ...]]:
    """The shapes tensor `<linear>.<suffix>` of a [N, K] linear may have in `fmt` (see the formats)."""
    n, k = full
    if suffix == "bias":
        return [(n,)]
    if suffix == "weight_shape":
        return [(2,)]
    if fmt == fp8.FORMAT:
        return [(n, k)] if suffix == "weight" else [(-(-n // BLOCK), -(-k // BLOCK))]
    int4 = scheme.name == W4A8
    if suffix == "weight_packed":
        return [(n, -(-k // 8))]
    if suffix == "weight":
        return [(n // 2, k)] if int4 and fmt == modelslim.FORMAT else [(n, k)]
    if suffix == "weight_scale" and fmt == compressed_tensors.FORMAT:
        return [(n, k // scheme.group_size if scheme.group_size else 1)]
    return [(n, 16), (n, 1)] if suffix == "scale_bias" else [(n, 1), (n,)]


def _aligned(part: slice, unit: int, full: int) -> slice:
    return slice(part.start - part.start % unit, min(-(-part.stop // unit) * unit, full))


class _Parts:
    """The blocks of one linear's stored tensors, read as `decode` reads a checkpoint (dtype and finiteness
    checked as the project's reader checks them)."""

    def __init__(self, parts: dict[str, torch.Tensor | None], where: Path) -> None:
        self.parts, self.where = parts, where

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def get(self, name: str, dtypes: Any = None) -> torch.Tensor | None:
        t = self.parts[name]
        return None if t is None else checked_tensor(name, t, self.where, dtypes)


class QuantStream:
    """Collects each rank's blocks of the quantized tensors as they stream by and sets each linear into
    the split model once all its tensors have come."""

    def __init__(self, model: nn.Module, names: dict[str, tuple[str, str]], tgts: dict[str, Target]) -> None:
        self.model, self.names, self.targets = model, names, tgts
        self.fmt = FORMATS[model.quant_format]
        self.plan = getattr(model, "glm5_plan", {})
        self.where = Path(getattr(model, "quant_path", "."))
        self.pending: dict[str, dict[str, torch.Tensor | None]] = {}
        self.done: set[str] = set()  # base names set (or held by another rank)

    def geometry(self, tgt: Target) -> tuple[int, slice, slice]:
        """(local expert index or SKIP (0 for a linear), rows, cols) of the full [N, K] this rank keeps."""
        n, k = tgt.full
        rows, cols = slice(0, n), slice(0, k)
        if tgt.expert is None:
            info = self.plan.get(f"{tgt.module}.weight")  # dim 0: rows, 1: columns (int4 stores bytes)
            if info is not None:
                size = tgt.full[info.dim] // info.size
                part = slice(info.rank * size, (info.rank + 1) * size)
                rows, cols = (part, cols) if info.dim == 0 else (rows, part)
            return 0, rows, cols
        info = self.plan.get(f"{tgt.module}.w13") or self.plan.get(f"{tgt.module}.gate_proj")
        if info is None:
            return tgt.expert, rows, cols
        if info.kind == "experts-ep":
            local = tgt.expert - info.start
            return (local if 0 <= local < info.length else SKIP), rows, cols
        inter = (k if tgt.proj == "down_proj" else n) // info.size
        mine = slice(info.rank * inter, (info.rank + 1) * inter)
        return (
            tgt.expert,
            (rows if tgt.proj == "down_proj" else mine),
            (mine if tgt.proj == "down_proj" else cols),
        )

    def add(self, hf: str, t: torch.Tensor) -> None:
        base, suffix = self.names[hf]
        tgt = self.targets[base]
        shapes = stored_shapes(self.model.quant_format, suffix, tgt.scheme, tgt.full)
        if tuple(t.shape) not in shapes:  # read from the header: nothing is sliced from a misfit
            raise CheckpointError([], [], [f"{hf} {list(t.shape)} (expected {list(shapes[0])})"])
        local, rows, cols = self.geometry(tgt)
        if local == SKIP:
            self.pending.setdefault(base, {})[suffix] = None
        else:
            ru, cu = self.fmt.band_units(tgt.scheme)
            part = self.fmt.band(
                suffix,
                t,
                tgt.scheme,
                _aligned(rows, ru, tgt.full[0]),
                _aligned(cols, cu, tgt.full[1]),
                tgt.full,
            )
            if part is not None:
                part = part.clone(memory_format=torch.contiguous_format)  # only the block is read
            self.pending.setdefault(base, {})[suffix] = part
        if set(self.pending[base]) >= set(tgt.stored):
            parts = self.pending.pop(base)
            if local != SKIP:
                self._set(tgt, local, rows, cols, {f"{base}.{s}": p for s, p in parts.items()}, base)
            self.done.add(base)

    def _set(self, tgt: Target, local: int, rows: slice, cols: slice, parts: dict, base: str) -> None:
        ru, cu = self.fmt.band_units(tgt.scheme)
        r0 = rows.start - _aligned(rows, ru, tgt.full[0]).start
        c0 = cols.start - _aligned(cols, cu, tgt.full[1]).start
        n, k = rows.stop - rows.start, cols.stop - cols.start
        reader = _Parts(parts, self.where)
        mod = self.model.get_submodule(tgt.module)
        if tgt.dequant:  # FP8 stored, a float parameter served (kv_b_proj): fp8.dequantize_weight_blocks
            q, s = (
                reader.get(f"{base}.weight", {E4M3}),
                reader.get(f"{base}.weight{fp8.SCALE_SUFFIX}", FLOAT_DTYPES),
            )
            first = (rows.start % BLOCK, cols.start % BLOCK)  # within the first block the scales cover
            blocks = s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            mod.weight.copy_(
                (q.float() * blocks[first[0] : first[0] + n, first[1] : first[1] + k]).to(mod.weight.dtype)
            )
            return
        if self.fmt is fp8:
            q = reader.get(f"{base}.weight", {E4M3})[r0 : r0 + n, c0 : c0 + k]
            s = reader.get(f"{base}.weight{fp8.SCALE_SUFFIX}", FLOAT_DTYPES).float()
            bias = reader.get(f"{base}.bias", FLOAT_DTYPES)[r0 : r0 + n] if f"{base}.bias" in reader else None
            mod.set_fp8(q, s, bias) if tgt.expert is None else mod.set_fp8(local, tgt.proj, q, s)
            return
        q, scale, bias = self.fmt.decode(base, tgt.scheme, reader)
        q = q[r0 : r0 + n, c0 : c0 + k]
        if scale.shape[1] > 1:  # per group: the block's groups
            gs = tgt.scheme.group_size
            scale = scale[:, c0 // gs : (c0 + k) // gs]
        scale = scale[r0 : r0 + n]
        if tgt.expert is None:
            mod.set_int(q, scale, None if bias is None else bias[r0 : r0 + n])
        else:
            mod.set_int(local, tgt.proj, q, scale)
