"""GLM-5-FP8 / DeepSeek-V3 FP8 checkpoints (e4m3, fp32 scales per 128x128 block): read, write, dequantize.

config.json `quantization_config`: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]} (+ `scale_fmt: ue8m0` in V3.1+/V3.2-style checkpoints). Every quantized
linear stores `<name>.weight` e4m3 [N, K] and `<name>.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)],
a multiplier despite the name: W = W_fp8 * scale_inv[n // 128, k // 128]. Kept in bf16 as published:
embeddings, lm_head, norms, the router gate (fp32 `e_score_correction_bias`), eh_proj, the indexer's
weights_proj and k_norm.

Loading (`load_fp8`): FP8 linears and routed experts become `FP8Linear` / `FP8Experts` (the backend's
FP8 ops). `kv_b_proj` is stored FP8 but de-quantized at load, as vLLM does, because the absorbed MLA
reads its weight directly. `dequantizing_reader` serves the float loader instead: each FP8 tensor is
de-quantized when it is read, block by block, so converting to W8A8 / W4A8 never holds an FP8 and a
float copy of more than one tensor at a time.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.formats import BLOCK, E4M3, cdiv, dequantize_weight_blocks, quantize_weight_blocks
from glm5.core.checkpoint import (
    FLOAT_DTYPES,
    BadCheckpointFile,
    CheckpointError,
    config_json,
    expected_shapes,
    fit_report,
)
from glm5.core.moe import Experts
from quant.formats.common import Scope, TensorReader, write_checkpoint
from quant.fp8_modules import EXPERT_PROJS, FP8Experts, FP8Linear

FORMAT = "fp8"
SCALE_SUFFIX = "_scale_inv"
#: module names kept in bf16 in published GLM-5-FP8 / DeepSeek-V3.2 FP8 checkpoints
KEEP_BF16 = ("model.embed_tokens", "lm_head", "*.mlp.gate", "*.eh_proj", "*.indexer.weights_proj")
#: stored FP8, de-quantized at load (the absorbed MLA reads the weight itself)
DEQUANT_AT_LOAD = ("*.self_attn.kv_b_proj",)


def quantization_config(ue8m0: bool = False) -> dict[str, Any]:
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": list(KEEP_BF16),
    }
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    return qc


def check_config(qc: dict[str, Any]) -> bool:
    """The checkpoint's quantization_config is one this loader reads; returns whether scales are UE8M0."""
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method: expected 'fp8', got {qc.get('quant_method')!r}")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size: expected [128, 128], got "
            f"{qc.get('weight_block_size')!r} (per-tensor FP8 is not this format)"
        )
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            "quantization_config: expected fmt e4m3 with dynamic activations, got "
            f"fmt={qc.get('fmt')!r}, activation_scheme={qc.get('activation_scheme')!r}"
        )
    return qc.get("scale_fmt") == "ue8m0"


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def fp8_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every linear / routed-experts module stored FP8."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, Experts, FP8Linear, FP8Experts)) and not _matches(n, KEEP_BF16)
    ]


def inventory_plan(model: nn.Module) -> dict[str, Any]:
    """module name -> a Scheme labelled FP8_BLOCK for every weight GLM-5-FP8 stores in FP8, with stacked
    experts named per projection as the deployment inventory counts them (glm5/deploy/inventory.py)."""
    from quant.recipe import Scheme

    fp8 = Scheme("FP8_BLOCK")
    out: dict[str, Any] = {}
    for name, mod in fp8_targets(model):
        if isinstance(mod, (Experts, FP8Experts)):
            out.update({f"{name}.0.{p}": fp8 for p in EXPERT_PROJS})
        else:
            out[name] = fp8
    return out


# -- export ----------------------------------------------------------------------------------------------


@torch.no_grad()
def tensors(model: nn.Module, scope: Scope = None) -> dict[str, torch.Tensor]:
    """The GLM-5-FP8 checkpoint tensors of the modules in `scope` (all by default): the FP8 targets
    block-quantized (or copied when already FP8), everything else as the model holds it."""
    from glm5.core.checkpoint import hf_names

    params = model.state_dict()
    out = {
        hf: (params[sd][e] if e is not None else params[sd]).detach().cpu().contiguous().clone()
        for hf, sd, e in hf_names(model)
        if scope is None or scope(sd.rsplit(".", 1)[0])
    }
    for name, mod in fp8_targets(model):
        if scope is not None and not scope(name):
            continue
        if isinstance(mod, FP8Linear):
            out.pop(f"{name}.weight_scale_inv", None)
            out[f"{name}.weight"], out[f"{name}.weight{SCALE_SUFFIX}"] = (
                mod.weight.cpu(),
                mod.weight_scale_inv.cpu(),
            )
        elif isinstance(mod, nn.Linear):
            out[f"{name}.weight"], out[f"{name}.weight{SCALE_SUFFIX}"] = quantize_weight_blocks(
                mod.weight.detach().cpu()
            )
        else:
            for e in range(mod.n_experts if isinstance(mod, FP8Experts) else mod.gate_proj.shape[0]):
                for p in EXPERT_PROJS:
                    key = f"{name}.{e}.{p}"
                    if isinstance(mod, FP8Experts):
                        q, s = (t.cpu() for t in mod.fp8_weight(e, p))
                        out.pop(f"{name}.{p}_scale_inv", None)
                    else:
                        q, s = quantize_weight_blocks(getattr(mod, p)[e].detach().cpu())
                    out[f"{key}.weight"], out[f"{key}.weight{SCALE_SUFFIX}"] = q, s
    return {
        k: v.contiguous().clone()
        for k, v in out.items()
        if not k.endswith("_scale_inv") or k.endswith(f".weight{SCALE_SUFFIX}")
    }


def metadata(model: nn.Module, plan: Any = None, names: Any = None, ue8m0: bool = False) -> tuple[dict, dict]:
    """(config.json, extra files) of a GLM-5-FP8-style checkpoint of `model` (may be on the meta device);
    the writers' common signature (no plan: every FP8 target is in the format itself)."""
    cfg = config_json(model)
    cfg["quantization_config"] = quantization_config(ue8m0)
    return cfg, {}


def export(model: nn.Module, path: Path, ue8m0: bool = False) -> None:
    """Write a float (or FP8-loaded) model as a GLM-5-FP8-style checkpoint."""
    cfg, extra = metadata(model, ue8m0=ue8m0)
    write_checkpoint(Path(path), cfg, tensors(model), extra)


# -- load ------------------------------------------------------------------------------------------------


def fp8_layout(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(name -> shape of every tensor a GLM-5-FP8 checkpoint of the float `model` stores, the names stored
    e4m3): each FP8 target's weight [N, K] is e4m3 with a `_scale_inv` [ceil(N/128), ceil(K/128)]; every
    other tensor is float, as in a float checkpoint."""
    shapes = expected_shapes(model)
    fp8: set[str] = set()
    for name, mod in fp8_targets(model):
        if isinstance(mod, nn.Linear):
            fp8.add(f"{name}.weight")
        else:
            fp8.update(f"{name}.{e}.{p}.weight" for e in range(mod.gate_proj.shape[0]) for p in EXPERT_PROJS)
    for w in fp8:
        n, k = shapes[w]
        shapes[f"{w}{SCALE_SUFFIX}"] = (cdiv(n, BLOCK), cdiv(k, BLOCK))
    return shapes, fp8


class DequantizingReader(TensorReader):
    """A TensorReader that returns FP8 weights de-quantized to `dtype` (one tensor at a time, block by
    block) and hides their `_scale_inv` companions: what the float loader expects. `fit` checks the
    stored names and shapes (scales included) against the model and must come before `get`: after it,
    the FP8 targets' weights must be stored e4m3 (scales fp32/bf16/fp16) and every other tensor float."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        super().__init__(path)
        self.dtype = dtype
        self._raw = TensorReader(path)  # every tensor as stored, scales included
        scale = f".weight{SCALE_SUFFIX}"
        self.where = {k: v for k, v in self.where.items() if not k.endswith(scale)}
        self.fp8: set[str] | None = None  # the names stored e4m3, known once `fit` ran

    def fit(self, model: nn.Module, copies: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
        """(missing, unexpected, mis-shaped) tensors, scales included, against a GLM-5-FP8 checkpoint of
        the float `model` (fp8_layout); reads headers only."""
        expected, self.fp8 = fp8_layout(model)
        return fit_report(model, self._raw.where, self._raw.shape, copies, expected)

    def fp8_pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight, fp32 scale_inv) of the FP8 weight `name`, as stored (checked dtypes, finite, the
        scales > 0)."""
        if self.fp8 is None:
            raise RuntimeError("DequantizingReader: call fit(model, copies) before reading tensors")
        q = super().get(name, {E4M3})
        key = f"{name}{SCALE_SUFFIX}"
        scale = self._raw.get(key, FLOAT_DTYPES).float()
        if not bool((scale > 0).all()):  # a multiplier <= 0 would negate or zero the block's weights
            raise BadCheckpointFile(self._raw.where[key], f"tensor {key} holds a scale <= 0 (expected > 0)")
        return q, scale

    def get(self, name: str, dtypes: Any = FLOAT_DTYPES) -> torch.Tensor:
        """The tensor `name` in float: an FP8 weight de-quantized to `dtype`, any other as stored (of
        `dtypes`)."""
        if self.fp8 is None:
            raise RuntimeError("DequantizingReader: call fit(model, copies) before reading tensors")
        if name in self.fp8:
            return dequantize_weight_blocks(*self.fp8_pair(name)).to(self.dtype)
        return super().get(name, dtypes)

    def close(self) -> None:
        super().close()
        self._raw.close()


@torch.no_grad()
def load_fp8(
    path: str | Path,
    backend: Any = None,
    dtype: torch.dtype | None = None,
    cls: type | None = None,
    fp8_modules: bool = True,
) -> nn.Module:
    """Build `cls` (GLM5ForCausalLM) from an FP8 checkpoint. fp8_modules=True: FP8Linear / FP8Experts on
    the backend's FP8 ops (the format served as published); False: every weight de-quantized to `dtype`
    (a float model, e.g. the source of `glm5 quantize`)."""
    from glm5.core.checkpoint import read_config, shared_copies, without_absent_mtp
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    path = Path(path)
    raw = read_config(path)
    ue8m0 = check_config(raw.get("quantization_config") or {})
    dtype = dtype or {"float32": torch.float32, "float16": torch.float16}.get(
        str(raw.get("dtype") or raw.get("torch_dtype")), torch.bfloat16
    )
    reader = DequantizingReader(path, dtype)
    config = without_absent_mtp(GLM5Config.from_dict(raw), reader.where, path)
    cls = cls or GLM5ForCausalLM
    with torch.device("meta"):
        model = cls(config, backend=backend, dtype=dtype)
    copies = {k: v for k, v in shared_copies(config).items() if k in reader}
    missing, unexpected, mismatched = reader.fit(model, copies)
    if missing or unexpected or mismatched:
        raise CheckpointError(missing, unexpected, mismatched)
    swapped = swap_fp8_modules(model, ue8m0) if fp8_modules else {}
    model.to_empty(device=model.backend.device)
    _fill(model, reader, swapped, copies)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fp8_ue8m0 = ue8m0
    return model.eval()


def swap_fp8_modules(model: nn.Module, ue8m0: bool) -> dict[str, nn.Module]:
    """Swap `FP8Linear` / `FP8Experts` (on the meta device) in for the float model's FP8 targets, except
    those de-quantized at load -> {module name: new module}."""
    swapped: dict[str, nn.Module] = {}
    for name, mod in fp8_targets(model):
        if _matches(name, DEQUANT_AT_LOAD):
            continue
        if isinstance(mod, nn.Linear):
            new = FP8Linear(
                mod.in_features, mod.out_features, model.backend, mod.bias is not None, ue8m0, "meta"
            )
        else:
            e, i, d = mod.gate_proj.shape
            new = FP8Experts(e, d, i, ue8m0, "meta")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
        swapped[name] = new
    return swapped


def _fill(
    model: nn.Module, reader: DequantizingReader, swapped: dict[str, nn.Module], copies: dict[str, str]
) -> None:
    """Fill the model whose FP8 targets are `swapped` in; names, shapes and leftovers were checked by
    `reader.fit`, dtypes and finiteness are checked as each tensor is read."""
    from glm5.core.checkpoint import check_shared_copy, hf_names

    for name, mod in swapped.items():
        if isinstance(mod, FP8Linear):
            mod.set_fp8(
                *reader.fp8_pair(f"{name}.weight"),
                reader.get(f"{name}.bias") if mod.bias is not None else None,
            )
        else:
            for e in range(mod.n_experts):
                for p in EXPERT_PROJS:
                    mod.set_fp8(e, p, *reader.fp8_pair(f"{name}.{e}.{p}.weight"))
    prefixes = tuple(f"{n}." for n in swapped)
    params = model.state_dict(keep_vars=True)
    for hf, sd, e in hf_names(model):
        if hf.startswith(prefixes) or sd not in params:
            continue
        t = reader.get(hf)
        dst = params[sd][e] if e is not None else params[sd]
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint: {hf} expected shape {list(dst.shape)}, got {list(t.shape)}")
        dst.copy_(t)
    for hf, sd in copies.items():
        check_shared_copy(hf, reader.get(hf), sd, params[sd])
    left = [n for n in reader.unused()]
    if left:
        raise ValueError(f"checkpoint: {len(left)} unexpected tensor(s): {', '.join(left[:20])}")


def band_units(scheme: Any = None) -> tuple[int, int]:
    """(rows, columns) of the [N, K] weight a slice of the stored tensors must come in: any (e4m3 is one
    byte per weight; the scales of every block the slice touches come with it)."""
    return 1, 1


def band(suffix: str, t: torch.Tensor, scheme: Any, rows: slice, cols: slice, full: Any) -> torch.Tensor:
    """The part of stored tensor `<linear>.<suffix>` that holds rows x cols of the linear's [N, K] weight
    (of `_scale_inv`: the 128 x 128 blocks they touch), sliced before anything is read."""
    if suffix == f"weight{SCALE_SUFFIX}":
        return t[rows.start // BLOCK : cdiv(rows.stop, BLOCK), cols.start // BLOCK : cdiv(cols.stop, BLOCK)]
    return t[rows, cols] if suffix == "weight" else t[rows]
