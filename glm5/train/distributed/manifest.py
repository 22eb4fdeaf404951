"""The manifest of a sharded checkpoint (glm5/train/distributed/checkpoint.py): what its save wrote, checked
by every loader before any shard is opened.

    CKPT/manifest.json  {"format": 1,
                         "files":   {"model/shard-00001-...safetensors": {"size": N, "sha256": HEX}, ...},
                         "tensors": {"model": {NAME: {"shape": [...], "dtype": "float32"}}, "optim": {...}}}

`verify` refuses in one line (BadCheckpointFile, naming the file and the problem): a file that is missing,
truncated or changed since the save, not a regular file (a FIFO or device is never opened: lstat first),
a symlink, a name leaving the checkpoint directory, a file the save did not write (DCP reads every
*.safetensors of a directory), and, from the shards' own headers, a tensor with another shape or dtype
than the save's, or pieces that overlap, leave part of a tensor unwritten or reach outside it. The
checksums are taken on the ranks in parallel at the save; at a load they are read by one process (the
launcher of `--nproc N`, or the single process), the ranks check everything else."""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from glm5.core.checkpoint import BadCheckpointFile

MANIFEST = "manifest.json"
FORMAT = 1
#: a part -> its directory in the checkpoint
PARTS = {"model": "model", "optim": "trainer/optim"}
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2}
_HEADER_MAX = 100 << 20


def tensor_specs(state: dict[str, torch.Tensor]) -> dict[str, dict]:
    """name -> the shape (global, for a DTensor) and dtype a save writes."""
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in state.items()
        if isinstance(v, (torch.Tensor, DTensor))
    }


def checkpoint_files(d: Path) -> list[str]:
    """Every file under the checkpoint directory `d` (relative names, sorted), the manifest excepted."""
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_record(path: Path) -> dict:
    """{"size", "sha256"} of the regular file `path`."""
    h = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, 1 << 22):
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return {"size": size, "sha256": h.hexdigest()}


def manifest_text(files: dict[str, dict], tensors: dict[str, dict]) -> str:
    man = {"format": FORMAT, "files": dict(sorted(files.items())), "tensors": tensors}
    return json.dumps(man, indent=1) + "\n"


def _bad(f: Path, problem: str) -> BadCheckpointFile:
    return BadCheckpointFile(f, problem)


def _check_name(root: Path, name: str) -> tuple[str, ...]:
    """The parts of a file name of the manifest, refused if it could leave the checkpoint directory."""
    parts = Path(name).parts
    if not name or os.path.isabs(name) or "\\" in name or ".." in parts or "." in parts:
        raise _bad(root / MANIFEST, f"names {name!r}, outside the checkpoint directory")
    return parts


def _lstat_inside(root: Path, name: str) -> os.stat_result:
    """lstat of root/name, every component below `root` checked: inside it, no symlink, the file regular."""
    f = root / name
    parts = _check_name(root, name)
    for i in range(1, len(parts) + 1):
        p = root.joinpath(*parts[:i])
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise _bad(f, "missing (the save wrote it)") from None
        except OSError as exc:
            raise _bad(f, exc.strerror or "cannot be read") from None
        if stat.S_ISLNK(st.st_mode):
            raise _bad(p, "is a symlink; a checkpoint's files are its own")
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f, "is not a regular file (not opened)")
    return st


def read_manifest(path: Path) -> dict:
    """CKPT/manifest.json, checked in form."""
    f = path / MANIFEST
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise _bad(f, "missing: a sharded checkpoint loads only with the manifest its save wrote") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f, "is not a regular file (not opened)")
    try:
        man = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f, f"not valid JSON ({str(exc).splitlines()[0]})") from None
    ok = (
        isinstance(man, dict)
        and man.get("format") == FORMAT
        and isinstance(man.get("files"), dict)
        and isinstance(man.get("tensors"), dict)
        and all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
            for r in man["files"].values()
        )
        and all(isinstance(man["tensors"].get(p, {}), dict) for p in PARTS)
    )
    if not ok:
        raise _bad(f, f"expected format {FORMAT} with 'files' (size, sha256) and 'tensors'")
    return man


def _header(f: Path, size: int) -> dict:
    """The safetensors header of the regular file `f`: {name: (dtype, shape, nbytes)}, and its metadata."""
    with open(f, "rb") as fh:
        raw = fh.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or n > min(size - 8, _HEADER_MAX):
            raise _bad(f, "not a safetensors file (its header length does not fit the file)")
        try:
            head = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise _bad(f, "not a safetensors file (its header is not JSON)") from None
    if not isinstance(head, dict):
        raise _bad(f, "not a safetensors file (its header is not an object)")
    meta = head.pop("__metadata__", None) or {}
    out = {}
    for name, rec in head.items():
        try:
            dtype = _ST_DTYPES[rec["dtype"]]
            shape = [int(s) for s in rec["shape"]]
            a, b = (int(x) for x in rec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _bad(f, f"tensor {name!r}: a header entry without known dtype, shape, offsets") from None
        if min(shape, default=0) < 0 or not 0 <= a <= b <= size - 8 - n:
            raise _bad(f, f"tensor {name!r}: its data lies outside the file (truncated?)")
        if dtype in _ITEMSIZE and b - a != math.prod(shape) * _ITEMSIZE[dtype]:
            raise _bad(f, f"tensor {name!r}: {b - a} bytes for shape {shape} in {dtype}")
        out[name] = (dtype, shape)
    return {"tensors": out, "meta": meta if isinstance(meta, dict) else {}}


def _check_pieces(d: Path, name: str, want: dict, pieces: list[tuple[list, list, str, Path]]) -> None:
    """The pieces (offsets, shape, dtype, file) of one tensor cover its saved shape exactly, in its dtype."""
    shape, dtype = want["shape"], want["dtype"]
    total = 0
    boxes = []
    for off, sizes, dt, f in pieces:
        if dt != dtype:
            raise _bad(f, f"tensor {name!r} is {dt}; the save wrote {dtype}")
        if len(off) != len(shape) or len(sizes) != len(shape):
            raise _bad(f, f"tensor {name!r}: a piece of shape {sizes} at {off}; the save wrote {shape}")
        if any(o < 0 or o + s > full for o, s, full in zip(off, sizes, shape, strict=True)):
            raise _bad(f, f"tensor {name!r}: a piece at {off} of {sizes} reaches outside its shape {shape}")
        for o2, s2, f2 in boxes:
            if all(
                max(a, b) < min(a + x, b + y) for a, x, b, y in zip(off, sizes, o2, s2, strict=True)
            ) and math.prod(sizes):
                raise _bad(f, f"tensor {name!r}: its piece at {off} overlaps the one at {o2} in {f2.name}")
        boxes.append((off, sizes, f))
        total += math.prod(sizes)
    if total != math.prod(shape):
        held = ", ".join(sorted({f.name for *_, f in pieces}))
        raise _bad(d, f"tensor {name!r}: its pieces (in {held}) hold {total} of {math.prod(shape)} elements")


def _check_part(path: Path, part: str, want: dict) -> None:
    d = path / PARTS[part]
    pieces: dict[str, list] = {}
    for f in sorted(d.iterdir()):
        head = _header(f, os.lstat(f).st_size)
        info = head["meta"].get("DCP_SHARDING_INFO")
        try:
            offsets = json.loads(info) if info is not None else {}
        except (TypeError, ValueError):
            raise _bad(f, "its DCP_SHARDING_INFO is not JSON") from None
        if not isinstance(offsets, dict):
            raise _bad(f, "its DCP_SHARDING_INFO is not an object")
        for name, (dtype, shape) in head["tensors"].items():
            rec = offsets.get(name, {"saved_offsets": [0] * len(shape)})
            off = rec.get("saved_offsets") if isinstance(rec, dict) else None
            if not (isinstance(off, list) and all(isinstance(o, int) for o in off)):
                raise _bad(f, f"tensor {name!r}: no saved offsets in its DCP_SHARDING_INFO")
            if name not in want:
                raise _bad(f, f"holds {name!r}, which the save did not write")
            pieces.setdefault(name, []).append((off, shape, dtype, f))
    for name, spec in want.items():
        if name not in pieces:
            raise _bad(d, f"tensor {name!r} is missing from every shard")
        _check_pieces(d, name, spec, pieces[name])


def verify(path: str | Path, trainer: bool, checksums: bool = True) -> dict:
    """Check the sharded checkpoint `path` against its manifest before anything of it is loaded (the
    model; with `trainer` the optimizer state, RNG and trainer state too); -> the manifest."""
    path = Path(path)
    man = read_manifest(path)
    files = man["files"]
    dirs = ["model", "trainer", "trainer/optim"] if trainer else ["model"]
    for (
        name
    ) in files:  # every name, the parts not loaded here too: a manifest naming a path outside is forged
        _check_name(path, name)
    need = {n for n in files if n == "config.json" or n.split("/")[0] in {d.split("/")[0] for d in dirs}}
    required = ("trainer/trainer_state.json", "trainer/optimizer.json") if trainer else ()
    for name in ("config.json", *required):
        if name not in files:
            raise _bad(path / MANIFEST, f"lists no {name}")
    for d in dirs:
        if not any(n.startswith(f"{d}/") for n in files):
            raise _bad(path / MANIFEST, f"lists no file under {d}/")
    for name in sorted(need):
        rec = files[name]
        st = _lstat_inside(path, name)
        if st.st_size != rec["size"]:
            what = "truncated" if st.st_size < rec["size"] else "longer than saved"
            raise _bad(path / name, f"{what}: {st.st_size} bytes, the save wrote {rec['size']}")
        if checksums and file_record(path / name)["sha256"] != rec["sha256"]:
            raise _bad(path / name, "changed since the save (its sha256 differs from the manifest's)")
    for d in dirs:
        try:
            entries = sorted(os.scandir(path / d), key=lambda e: e.name)
        except OSError as exc:
            raise _bad(path / d, exc.strerror or "cannot be listed") from None
        for e in entries:
            rel = f"{d}/{e.name}"
            if rel not in files and not (e.is_dir(follow_symlinks=False) and f"{rel}" in dirs):
                raise _bad(path / rel, "not written by the save (not in manifest.json); loaders read it")
    for part in ("model", "optim") if trainer else ("model",):
        _check_part(path, part, man["tensors"].get(part, {}))
    if trainer:
        _check_optimizer_refs(path / "trainer" / "optimizer.json", man["tensors"].get("optim", {}))
    return man


def _check_optimizer_refs(f: Path, saved: dict) -> None:
    """optimizer.json names each optimizer tensor the save wrote, and no other: a parameter whose state
    entry was dropped would resume with a fresh state (set_optimizer_state_dict is not strict, since a
    parameter that never had a gradient has none) and train on silently."""
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
        refs = {
            v["__tensor__"]
            for st in meta["state"].values()
            for v in st.values()
            if isinstance(v, dict) and "__tensor__" in v
        }
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise _bad(f, "expected an object with 'state' (per parameter) and 'param_groups'") from None
    lost, extra = sorted(set(saved) - refs), sorted(refs - set(saved))
    if lost or extra:
        which = (
            f"names no state for {lost[0]!r}" if lost else f"names {extra[0]!r}, which the save did not write"
        )
        raise _bad(
            f, f"{which} ({len(lost)} missing, {len(extra)} unknown): the optimizer state is incomplete"
        )
