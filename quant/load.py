"""Export a quantized model and load either checkpoint format back into `GLM5ForCausalLM`.

`glm5.loader.load_model(DIR)` reads either kind (it asks `detect_format` here, the one detection);
`GLM5ForCausalLM.from_pretrained` reads float checkpoints only (docs/quantization.md).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from backends import Backend
from quant.apply import empty_like_plan
from quant.formats import compressed_tensors, fp8, modelslim
from quant.formats.common import TensorReader, fill_model

FORMATS: dict[str, ModuleType] = {compressed_tensors.FORMAT: compressed_tensors, modelslim.FORMAT: modelslim}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def detect_format(path: str | Path) -> str | None:
    """'modelslim', 'compressed-tensors', or None for a float checkpoint."""
    from glm5.core.checkpoint import read_config

    path = Path(path)
    if (path / modelslim.DESCRIPTION).is_file():
        return modelslim.FORMAT
    if (path / "config.json").exists():
        qc = read_config(path).get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(
                f"{path / 'config.json'}: quantization_config: expected an object, got {type(qc).__name__}"
            )
        if qc:
            if qc.get("quant_method") == fp8.FORMAT:
                return fp8.FORMAT  # GLM-5-FP8 / DeepSeek block FP8 (quant/formats/fp8.py)
            if qc.get("quant_method") != "compressed-tensors":
                raise ValueError(
                    f"quantization_config.quant_method: expected 'compressed-tensors', "
                    f"got {qc.get('quant_method')!r}"
                )
            return compressed_tensors.FORMAT
    return None


def is_quantized(path: str | Path) -> bool:
    return detect_format(path) is not None


def export(model: nn.Module, path: str | Path, fmt: str) -> None:
    """Write the quantized `model` to `path` as `fmt` ('compressed-tensors' or 'modelslim')."""
    if fmt == fp8.FORMAT:
        return fp8.export(model, Path(path))
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {sorted(FORMATS) + [fp8.FORMAT]}, got {fmt!r}")
    FORMATS[fmt].export(model, Path(path))


@torch.no_grad()
def load_quantized(
    path: str | Path,
    backend: Backend | str | None = None,
    dtype: torch.dtype | None = None,
    cls: type | None = None,
) -> nn.Module:
    """Build the model from `path`/config.json on the meta device, swap in the quantized modules the
    checkpoint describes, and fill every tensor (strict: nothing missing, nothing left over)."""
    path = Path(path)
    if _format_of(path) == fp8.FORMAT:
        return fp8.load_fp8(path, backend=backend, dtype=dtype, cls=cls)
    model = skeleton(path, backend, dtype, cls)
    model.to_empty(device=model.backend.device)
    fill_model(model, TensorReader(path), FORMATS[model.quant_format].decode)
    model.prepare_weights()  # the backend lays the loaded weights out once
    return model.eval()


def _format_of(path: Path) -> str:
    fmt = detect_format(path)
    if fmt is None:
        raise ValueError(
            f"path: {path} holds no quantized checkpoint (no {modelslim.DESCRIPTION}, "
            "no quantization_config in config.json)"
        )
    return fmt


def skeleton(
    path: str | Path, backend: Backend | str | None = None, dtype: torch.dtype | None = None, cls=None
) -> nn.Module:
    """The quantized model `path` holds, on the meta device, built from its config files and tensor names
    only (no tensor is read): the quantized modules its quantization config describes swapped in.
    `model.quant_format` names the format; `quant_plan` (int8/int4) or `fp8_ue8m0` (FP8) say the rest.
    A loader then fills it (`load_quantized`, or the vLLM plugin's sharded loader)."""
    from glm5.core.checkpoint import TensorFiles, read_config, without_absent_mtp
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    path = Path(path)
    fmt = _format_of(path)
    raw = read_config(path)
    config = without_absent_mtp(GLM5Config.from_dict(raw), TensorFiles(path).where, path)
    default = torch.bfloat16 if fmt == fp8.FORMAT else torch.float32  # GLM-5-FP8 is served in bf16
    dtype = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), default)
    with torch.device("meta"):
        model = (cls or GLM5ForCausalLM)(config, backend=backend, dtype=dtype)
    if fmt == fp8.FORMAT:
        model.fp8_ue8m0 = fp8.check_config(raw.get("quantization_config") or {})
        fp8.swap_fp8_modules(model, model.fp8_ue8m0)
    else:
        model.quant_plan = FORMATS[fmt].read_plan(path, model)
        empty_like_plan(model, model.quant_plan, device="meta")
    model.quant_format, model.quant_path = fmt, path
    return model
