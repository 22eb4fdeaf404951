"""Hugging Face checkpoints: `config.json` + safetensors with the published `glm_moe_dsa` names,
one file or shards with `model.safetensors.index.json`.

In memory the routed experts are stacked (`mlp.experts.gate_proj [E, I, D]`) for grouped GEMM; on
disk each expert has its own tensors (`mlp.experts.{e}.gate_proj.weight`). Every other name maps 1:1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from glm5.core.config import GLM5Config
from glm5.infra import fsio

log = logging.getLogger("glm5")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: a stacked routed-expert parameter of the model ([E, ...]); groups: the experts module, the projection.
#: Its checkpoint names are `<group 1>.<e>.<group 2>.weight`, one per expert (every reader and writer).
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the dtypes a float checkpoint may store (anything else would be cast silently)
FLOAT_DTYPES = frozenset(_DTYPES.values())


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


class BadCheckpointFile(CheckpointError):
    """A file of the checkpoint that cannot be read, or holds a tensor or field that cannot be loaded: one
    line naming the file and what is wrong."""

    def __init__(self, file: str | Path, problem: str) -> None:
        self.missing, self.unexpected, self.mismatched = [], [], []
        self.file = Path(file)
        ValueError.__init__(self, f"{file}: {problem}")


def open_tensors(f: Path) -> Any:
    """A safetensors handle on `f`; a truncated, empty or malformed file (bad header, JSON, offsets)
    raises BadCheckpointFile naming it."""
    try:
        return safe_open(f, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise BadCheckpointFile(f, f"not a readable safetensors file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _nonfinite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:  # no inf; NaN is the byte pattern s.1111.111 (isfinite lacks fp8)
        return bool((t.view(torch.uint8) & 0x7F).eq(0x7F).any())
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t = t.float()
    return t.dtype.is_floating_point and not bool(torch.isfinite(t).all())


def checked_tensor(name: str, t: torch.Tensor, file: Path, dtypes: Any = None) -> torch.Tensor:
    """`t` as read from `file`, refused (BadCheckpointFile naming the tensor and its dtype) when its dtype
    is not one of `dtypes` (None: any) or it holds NaN or inf (no tensor of the model may)."""
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise BadCheckpointFile(
            file, f"tensor {name}: expected dtype {want}, got {str(t.dtype).removeprefix('torch.')}"
        )
    if _nonfinite(t):
        raise BadCheckpointFile(file, f"tensor {name} holds NaN or inf")
    return t


class TensorFiles:
    """The tensors of a checkpoint directory by name (`weight_files`), each read through
    `checked_tensor`; files are opened once, on first use."""

    def __init__(self, path: Path, index_name: str = INDEX_FILE) -> None:
        self.where = weight_files(Path(path), index_name)
        self._h: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _handle(self, name: str) -> Any:
        if name not in self.where:
            raise KeyError(f"checkpoint: tensor {name} missing")
        f = self.where[name]
        if f not in self._h:
            self._h[f] = open_tensors(f)
        return self._h[f]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header only."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, dtypes: Any = None) -> torch.Tensor:
        """The tensor `name`, of one of `dtypes` (None: any) and finite."""
        try:
            t = self._handle(name).get_tensor(name)
        except SafetensorError as exc:
            raise BadCheckpointFile(self.where[name], f"tensor {name}: {_first_line(exc)}") from None
        return checked_tensor(name, t, self.where[name], dtypes)

    def close(self) -> None:
        """Drop the open files (and their memory maps: the pages read so far stop counting as this
        process's memory); the next `get` reopens what it needs."""
        self._h.clear()


def hf_names(model: torch.nn.Module) -> Iterator[tuple[str, str, int | None]]:
    """(checkpoint name, model state_dict name, expert index or None) for every stored tensor."""
    yield from state_hf_names(model.state_dict(keep_vars=True), model.config.tie_word_embeddings)


def state_hf_names(state: Mapping[str, torch.Tensor], tied: bool) -> Iterator[tuple[str, str, int | None]]:
    """`hf_names` of a model's state dict (e.g. one gathered from shards): stacked experts unstacked, a
    tied head left out."""
    for name, p in state.items():
        if tied and name == "lm_head.weight":
            continue
        m = STACKED_EXPERTS.match(name)
        if m:
            for e in range(p.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", name, e
        else:
            yield name, name, None


def shared_copies(config: GLM5Config) -> dict[str, str]:
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
        target = path.parent / os.readlink(path) if path.is_symlink() else path  # e.g. a dangling `latest`
        aside = fsio.set_aside(target)
        if aside:
            raise NotACheckpoint(
                f"{path} is not a directory: an interrupted save set the previous copy aside as {aside[0]}; "
                "the next write to this output (glm5 train --resume, glm5 quantize) puts it back"
            )
        raise NotACheckpoint(f"{path} is not a directory")
    cfg = path / "config.json"
    if not cfg.exists():
        hint = ""
        if (path / "checkpoints" / "latest").exists():
            hint = f" (a training run: pass {path / 'checkpoints' / 'latest'})"
        elif path.name == "checkpoints" and (path / "latest").exists():
            hint = f" (pass {path / 'latest'})"
        raise NotACheckpoint(f"{path} is not a checkpoint: no config.json{hint}")
    fsio.inside(path, "config.json", "config.json")  # a symlink out of the checkpoint is refused
    return path


def read_json(root: Path, name: str) -> Any:
    """The JSON file `root/name` (a regular file inside `root`), parsed; BadCheckpointFile naming it when
    it is not valid JSON."""
    return _read_json(fsio.inside(root, name, name))


def _read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadCheckpointFile(f, f"not valid JSON ({_first_line(exc)})") from None


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the checkpoint `path`, checked: a JSON object whose fields GLM5Config accepts
    (type and range of each; BadCheckpointFile naming the file and the field otherwise)."""
    f = check_dir(path) / "config.json"
    raw = _read_json(f)
    if not isinstance(raw, dict):
        raise NotACheckpoint(f"{f}: expected a JSON object, got {type(raw).__name__}")
    try:
        GLM5Config.from_dict(raw)
    except ValueError as exc:
        raise BadCheckpointFile(f, _first_line(exc)) from None
    return raw


def weight_files(path: Path, index_name: str = INDEX_FILE) -> dict[str, Path]:
    """Tensor name -> shard file, from the index or from every *.safetensors; every file must be a
    regular file inside `path` (an index cannot point elsewhere)."""
    index = path / index_name
    if index.exists():
        fsio.regular_file(index, index_name)
        wmap = _read_json(index)
        wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
        if not isinstance(wmap, dict):
            raise BadCheckpointFile(index, "expected an object with a 'weight_map' object")
        files = {v: fsio.inside(path, v, f"{index_name} weight_map") for v in set(wmap.values())}
        for v, f in files.items():  # headers only: every tensor the index names is in its shard
            with open_tensors(f) as h:
                held = set(h.keys())
            absent = sorted(k for k, file in wmap.items() if file == v and k not in held)
            if absent:
                raise BadCheckpointFile(
                    f, f"lacks {len(absent)} tensor(s) {index_name} places there: {', '.join(absent[:5])}"
                )
        return {k: files[v] for k, v in wmap.items()}
    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        fsio.inside(path, f.name, "path")
        with open_tensors(f) as h:
            for k in h.keys():
                if k in out:
                    raise BadCheckpointFile(
                        path,
                        f"tensor {k} is in both {out[k].name} and {f.name} (and no "
                        f"{index_name} says which to use)",
                    )
                out[k] = f
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
        "%s: no tensors for MTP layer(s) %d-%d (num_nextn_predict_layers=%d): loaded with %d MTP layer(s)%s",
        path,
        n + keep,
        n + declared - 1,
        declared,
        keep,
        "; speculative decoding (--mtp) is unavailable" if keep == 0 else "",
    )
    return dataclasses.replace(config, num_nextn_predict_layers=keep)


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a float checkpoint of `model` stores."""
    params = model.state_dict(keep_vars=True)
    return {
        hf: tuple(params[sd].shape[1:] if e is not None else params[sd].shape)
        for hf, sd, e in hf_names(model)
    }


def fit_report(
    model: torch.nn.Module,
    present: Any,
    shape_of: Any,
    copies: dict[str, str],
    expected: dict[str, tuple[int, ...]] | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mis-shaped) tensors of a checkpoint holding the names `present`, with stored
    shapes `shape_of(name)`, against `expected` (name -> shape; default `expected_shapes(model)`, a float
    checkpoint); `copies` (`shared_copies`) are accepted when present, at the shape of the tensor they
    repeat."""
    params = model.state_dict(keep_vars=True)
    expected = expected_shapes(model) if expected is None else expected
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
    files = TensorFiles(path)
    wmap = files.where
    config = without_absent_mtp(GLM5Config.from_dict(raw), wmap, path)
    dtype = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.float32)
    with torch.device("meta"):
        model = cls(config, backend=backend, dtype=dtype)
    device = model.backend.device
    expected = {hf: (sd, e) for hf, sd, e in hf_names(model)}
    copies = shared_copies(config)
    missing, unexpected, mismatched = fit_report(model, wmap, files.shape, copies)
    if missing or mismatched or (unexpected and strict):
        raise CheckpointError(missing, unexpected if strict else [], mismatched)
    model.to_empty(device=device)
    params = model.state_dict(keep_vars=True)  # to_empty made new parameters
    for hf, (sd, e) in expected.items():
        t = files.get(hf, FLOAT_DTYPES)
        (params[sd][e] if e is not None else params[sd]).copy_(t)
    for hf, sd in copies.items():
        if hf in wmap:
            check_shared_copy(hf, files.get(hf, FLOAT_DTYPES), sd, params[sd])
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (experts unstacked; copies, so shards never share
    storage, which safetensors refuses)."""
    params = model.state_dict()
    return {
        hf: (params[sd][e] if e is not None else params[sd]).detach().to("cpu").contiguous().clone()
        for hf, sd, e in hf_names(model)
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
        fsio.save_tensors(
            {k: t.contiguous() for k, t in tensors.items()}, self.tmp / fname, metadata={"format": "pt"}
        )
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


def write_shards(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    max_shard_size: int,
    extra_files: dict[str, Any] | None = None,
) -> None:
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
