"""Hugging Face checkpoints: `config.json` + safetensors with the published `glm_moe_dsa` names,
one file or shards with `model.safetensors.index.json`.

In memory the routed experts are stacked (`mlp.experts.gate_proj [E, I, D]`) for grouped GEMM; on
disk each expert has its own tensors (`mlp.experts.{e}.gate_proj.weight`). Every other name maps 1:1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from glm5 import fsio
from glm5.config import GLM5Config

log = logging.getLogger("glm5")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: every missing, unexpected and mis-shaped tensor by name."""

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[str]) -> None:
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        parts = []
        for what, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched)):
            if names:
                shown = ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
                parts.append(f"{len(names)} {what} tensor(s): {shown}")
        super().__init__("checkpoint does not match the model: " + "; ".join(parts))


def _hf_names(model: torch.nn.Module) -> Iterator[tuple[str, str, int | None]]:
    """(checkpoint name, model state_dict name, expert index or None) for every stored tensor."""
    tied = model.config.tie_word_embeddings
    for name, p in model.state_dict(keep_vars=True).items():
        if tied and name == "lm_head.weight":
            continue
        m = _STACKED.match(name)
        if m:
            for e in range(p.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", name, e
        else:
            yield name, name, None


def _shared_copies(config: GLM5Config) -> dict[str, str]:
    """DeepSeek-style checkpoints repeat the shared embedding and head inside each MTP layer."""
    out = {}
    for j in range(config.num_nextn_predict_layers):
        pre = f"model.layers.{config.num_hidden_layers + j}"
        out[f"{pre}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{pre}.shared_head.head.weight"] = "lm_head.weight"
    return out


class NotACheckpoint(ValueError):
    """A directory that holds no checkpoint (one line: what is missing, and what to pass instead)."""


def check_dir(path: str | Path) -> Path:
    """`path` as a checkpoint directory (symlinks such as `checkpoints/latest` resolved), or
    NotACheckpoint saying why not; a training run directory gets a hint to its latest checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise NotACheckpoint(f"{path} is not a directory")
    cfg = path / "config.json"
    if not cfg.exists():
        hint = ""
        if (path / "checkpoints" / "latest").exists():
            hint = f" (a training run: pass {path / 'checkpoints' / 'latest'})"
        elif path.name == "checkpoints" and (path / "latest").exists():
            hint = f" (pass {path / 'latest'})"
        raise NotACheckpoint(f"{path} is not a checkpoint: no config.json{hint}")
    fsio.regular_file(cfg, "config.json")
    return path


def read_config(path: Path) -> dict[str, Any]:
    raw = json.loads((check_dir(path) / "config.json").read_text())
    if not isinstance(raw, dict):
        raise NotACheckpoint(f"{path}/config.json: expected a JSON object, got {type(raw).__name__}")
    return raw


def weight_files(path: Path, index_name: str = INDEX_FILE) -> dict[str, Path]:
    """Tensor name -> shard file, from the index or from every *.safetensors; every file must be a
    regular file inside `path` (an index cannot point elsewhere)."""
    index = path / index_name
    if index.exists():
        fsio.regular_file(index, index_name)
        wmap = json.loads(index.read_text()).get("weight_map")
        if not isinstance(wmap, dict):
            raise ValueError(f"{index_name}: expected a 'weight_map' object")
        files = {v: fsio.inside(path, v, f"{index_name} weight_map") for v in set(wmap.values())}
        return {k: files[v] for k, v in wmap.items()}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        fsio.inside(path, f.name, "path")
        with safe_open(f, framework="pt") as h:
            out.update({k: f for k in h.keys()})
    if not out:
        raise NotACheckpoint(f"{path} is not a checkpoint: no {index_name} and no *.safetensors")
    return out


def without_absent_mtp(config: GLM5Config, names: Any, path: Path) -> GLM5Config:
    """The config with num_nextn_predict_layers lowered to the MTP layers the checkpoint holds, when the
    trailing ones have no tensor at all (a transformers-saved checkpoint, or one whose MTP layer was
    dropped): logged once, speculative decoding then unavailable. A partly present layer is kept, so its
    missing tensors fail by name."""
    n, declared = config.num_hidden_layers, config.num_nextn_predict_layers
    layers = {int(m.group(1)) for m in map(re.compile(r"^model\.layers\.(\d+)\.").match, names) if m}
    keep = max([j + 1 for j in range(declared) if n + j in layers], default=0)
    if keep == declared:
        return config
    log.warning(
        "%s: no tensors for MTP layer(s) %s (num_nextn_predict_layers=%d): loaded with %d MTP layer(s)%s",
        path, list(range(n + keep, n + declared)), declared, keep,
        "; speculative decoding (--mtp) is unavailable" if keep == 0 else "",
    )
    return dataclasses.replace(config, num_nextn_predict_layers=keep)


def _shape_of(handle: Any, name: str) -> tuple[int, ...]:
    return tuple(handle.get_slice(name).get_shape())


def fit_report(
    model: torch.nn.Module, present: Any, shape_of: Any, copies: dict[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mis-shaped) tensors of a checkpoint holding the names `present`, with stored
    shapes `shape_of(name)`, against `model`; `copies` (`_shared_copies`) are accepted when present, at
    the shape of the tensor they repeat."""
    params = model.state_dict(keep_vars=True)
    expected = {
        hf: tuple(params[sd].shape[1:] if e is not None else params[sd].shape)
        for hf, sd, e in _hf_names(model)
    }
    missing = sorted(k for k in expected if k not in present)
    unexpected = sorted(k for k in present if k not in expected and k not in copies)
    mismatched = [
        f"{hf} (expected {list(want)}, got {list(shape_of(hf))})"
        for hf, want in expected.items()
        if hf in present and shape_of(hf) != want
    ]
    for hf, sd in copies.items():
        if hf in present and shape_of(hf) != tuple(params[sd].shape):
            mismatched.append(f"{hf} (expected {list(params[sd].shape)} as {sd}, got {list(shape_of(hf))})")
    return missing, unexpected, mismatched


def check_shared_copy(hf: str, stored: torch.Tensor, sd: str, param: torch.Tensor) -> None:
    """A DeepSeek-style MTP copy must equal the tensor it repeats (CheckpointError naming both)."""
    if not torch.equal(stored.to(param.device, param.dtype), param):
        raise CheckpointError([], [], [f"{hf} (differs from {sd}, which the MTP layer shares)"])


@torch.no_grad()
def load_pretrained(
    cls: type, path: str | Path, backend: Any, dtype: torch.dtype | None, strict: bool
) -> Any:
    path = Path(path)
    raw = read_config(path)
    wmap = weight_files(path)
    config = without_absent_mtp(GLM5Config.from_dict(raw), wmap, path)
    dtype = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.float32)
    with torch.device("meta"):
        model = cls(config, backend=backend, dtype=dtype)
    device = model.backend.device
    expected = {hf: (sd, e) for hf, sd, e in _hf_names(model)}
    copies = _shared_copies(config)
    handles: dict[Path, Any] = {}

    def handle(f: Path) -> Any:
        if f not in handles:
            handles[f] = safe_open(f, framework="pt", device="cpu")
        return handles[f]

    def shape_of(hf: str) -> tuple[int, ...]:
        return _shape_of(handle(wmap[hf]), hf)

    missing, unexpected, mismatched = fit_report(model, wmap, shape_of, copies)
    if missing or mismatched or (unexpected and strict):
        raise CheckpointError(missing, unexpected if strict else [], mismatched)
    model.to_empty(device=device)
    params = model.state_dict(keep_vars=True)  # to_empty made new parameters
    for hf, (sd, e) in expected.items():
        t = handle(wmap[hf]).get_tensor(hf)
        (params[sd][e] if e is not None else params[sd]).copy_(t)
    for hf, sd in copies.items():
        if hf in wmap:
            check_shared_copy(hf, handle(wmap[hf]).get_tensor(hf), sd, params[sd])
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (experts unstacked; copies, so shards never share
    storage, which safetensors refuses)."""
    params = model.state_dict()
    return {
        hf: (params[sd][e] if e is not None else params[sd]).detach().to("cpu").contiguous().clone()
        for hf, sd, e in _hf_names(model)
    }


STAGING = ".{}.tmp-"  # staging siblings of a checkpoint NAME: .NAME.tmp-PID-XXXX


class ShardWriter:
    """A checkpoint written shard by shard into a staging sibling of `path` and swapped into place by
    `finish` (fsio.publish_dir): a reader never sees half a checkpoint, the path never lacks one, and a
    writer killed at any point leaves the previous checkpoint intact (the next writer removes its staging
    directory). Each `add` is one shard on disk at once, so a converter streaming layer by layer holds
    one layer's tensors, never the model's. Use as a context manager: an exception removes the staging.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._prefix = STAGING.format(self.path.name)
        self.tmp = fsio.staging_dir(self.path.parent, self._prefix)
        self._parts: list[tuple[str, list[str]]] = []
        self.names: set[str] = set()
        self.total_size = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` (CPU; names new to this checkpoint) as one more shard."""
        if not tensors:
            return
        again = sorted(self.names & set(tensors))
        if again:
            raise ValueError(f"checkpoint: tensor(s) written twice: {', '.join(again[:5])}")
        fname = f"part-{len(self._parts):05d}.safetensors"
        fsio.save_tensors({k: t.contiguous() for k, t in tensors.items()}, self.tmp / fname,
                          metadata={"format": "pt"})
        self._parts.append((fname, list(tensors)))
        self.names.update(tensors)
        self.total_size += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self, config: dict[str, Any], extra_files: dict[str, Any] | None = None) -> None:
        """Name the shards as Hugging Face does (one `model.safetensors`, or `model-0000i-of-0000N` plus
        the index), write config.json and the extra JSON files, and publish."""
        n = len(self._parts)
        wmap = {}
        for i, (part, names) in enumerate(self._parts):
            fname = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.tmp / part).rename(self.tmp / fname)
            wmap.update({k: fname for k in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": wmap}
            fsio.write_text(self.tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
        for fname, obj in (extra_files or {}).items():
            fsio.write_text(self.tmp / fname, json.dumps(obj, indent=2) + "\n")
        fsio.write_text(self.tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        fsio.publish_dir(self.tmp, self.path, self._prefix)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def write_shards(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 max_shard_size: int, extra_files: dict[str, Any] | None = None) -> None:
    """Write a whole checkpoint held in memory, in shards of at most `max_shard_size` bytes (a tensor
    larger than that gets a shard of its own), atomically (ShardWriter)."""
    with ShardWriter(path) as w:
        shard: dict[str, torch.Tensor] = {}
        size = 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            if shard and size + n > max_shard_size:
                w.add(shard)
                shard, size = {}, 0
            shard[name] = t
            size += n
        w.add(shard)
        w.finish(config, extra_files)


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_size: int) -> None:
    """The float model as a Hugging Face checkpoint, atomically (ShardWriter)."""
    write_shards(path, config_json(model), hf_state_dict(model), max_shard_size)


def config_json(model: torch.nn.Module) -> dict[str, Any]:
    """config.json of a checkpoint of `model`: its config plus the dtype its float tensors are stored in."""
    cfg = model.config.to_dict()
    cfg["dtype"] = str(model.dtype).removeprefix("torch.")
    return cfg
