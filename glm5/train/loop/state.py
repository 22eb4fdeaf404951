"""Training checkpoints: the model in the Hugging Face layout (`save_pretrained`) plus what a bit-exact
resume needs, tensors in safetensors and the rest in JSON (no pickle anywhere):

    DIR/checkpoints/step-000200/  config.json, model.safetensors   (loadable by from_pretrained)
      trainer/optimizer.safetensors, trainer/optimizer.json           (state_dict of each optimizer)
      trainer/rng.safetensors                                         (torch CPU / accelerator RNG)
      trainer/trainer_state.json                                      (step = data position, run options)
    DIR/checkpoints/latest -> step-000200    symlink to the newest complete checkpoint (a path:
                                              `glm5 generate --model DIR/checkpoints/latest`)

A checkpoint is assembled (and fsynced) in a staging directory and renamed into place; `latest` is
re-pointed atomically after that (a new symlink renamed over the old), so an interrupted save leaves
the previous checkpoint intact and current, and the next save removes the staging it left (and puts
back a checkpoint that a save without RENAME_EXCHANGE had set aside, fsio.recover). A pruned checkpoint
is renamed to a trash name before it is deleted. Older runs wrote `latest` as a text file holding the
name; it is still read.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from glm5.core.checkpoint import BadCheckpointFile, open_tensors, read_json
from glm5.infra import fsio

LATEST = "latest"
TRAINER = "trainer"
STAGING = ".staging-"
_STEP = re.compile(r"^step-(\d+)$")


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """A JSON-able copy with tensors moved into `tensors` (keys `prefix.N`); int dict keys, tuples kept."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _flatten(v, tensors, prefix) for k, v in obj.items()}
        return {"__items__": [[k, _flatten(v, tensors, prefix)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, tensors, prefix) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"state: cannot store {type(obj).__name__} without pickle")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def _accelerator() -> tuple[str, object] | None:
    """(device type, its torch module) of the machine's accelerator (cuda, npu, xpu, ...), if any: RNG
    states are saved for whichever one torch_npu or another device plugin registered, not only CUDA."""
    if not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator().type
    return kind, torch.get_device_module(kind)


def rng_state() -> dict[str, torch.Tensor]:
    """The CPU generator's state and every accelerator device's, as `cpu` and `<type>.<index>`."""
    out = {"cpu": torch.get_rng_state()}
    acc = _accelerator()
    if acc is not None:
        kind, mod = acc
        for i, s in enumerate(mod.get_rng_state_all()):
            out[f"{kind}.{i}"] = s
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` saved; accelerator states are restored on the same accelerator type (a
    run resumed on another kind of machine continues with that machine's fresh device generators)."""
    torch.set_rng_state(states["cpu"])
    acc = _accelerator()
    if acc is not None:
        kind, mod = acc
        saved = sorted((int(k.split(".", 1)[1]), k) for k in states if k.startswith(f"{kind}."))
        if saved:
            mod.set_rng_state_all([states[k] for _, k in saved])


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: Any,
    optimizers: list[torch.optim.Optimizer],
    trainer: dict,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step-{step:06d}` under ckpt_root atomically, point `latest` at it, then keep
    the newest `keep` checkpoints of steps up to this one (by step number; never the one just written,
    never a later step)."""
    name = f"step-{step:06d}"
    staging = fsio.staging_dir(ckpt_root, STAGING)
    try:
        d = staging / name
        model.save_pretrained(d)
        t = d / TRAINER  # a subdirectory: from_pretrained reads every *.safetensors at the top level
        t.mkdir(mode=fsio.dir_mode())
        tensors: dict[str, torch.Tensor] = {}
        meta = [_flatten(o.state_dict(), tensors, f"opt{i}") for i, o in enumerate(optimizers)]
        fsio.save_tensors(tensors, t / "optimizer.safetensors")
        fsio.write_text(t / "optimizer.json", json.dumps({"optimizers": meta}, indent=1) + "\n")
        fsio.save_tensors(rng_state(), t / "rng.safetensors")
        fsio.write_text(t / "trainer_state.json", json.dumps(dict(trainer, step=step), indent=2) + "\n")
        final = ckpt_root / name
        fsio.publish_dir(d, final, STAGING)  # re-saving a step after a resume swaps the old one out
        fsio.point_symlink(ckpt_root / LATEST, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    older = sorted((s, p) for s, p in checkpoints(ckpt_root) if s < step)
    for _, old in older[: max(len(older) - (keep - 1), 0)]:
        fsio.remove_dir(old)  # renamed to a trash name first: never a half-deleted step-N
    return final


def checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every `step-N` checkpoint under ckpt_root."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `latest` names (a symlink, or the text file older runs wrote), if it exists; without
    `latest`, the newest `step-N` (a run killed between its first publish and pointing `latest` at it: a
    published checkpoint is complete, the publish is one rename)."""
    f = ckpt_root / LATEST
    if f.is_symlink():
        path = ckpt_root / Path(f.readlink()).name
    elif f.is_file():
        path = ckpt_root / Path(f.read_text().strip()).name
    else:
        found = checkpoints(ckpt_root)
        return found[-1][1] if found else None
    return path if _STEP.match(path.name) and path.is_dir() else None


def load_trainer_state(path: Path) -> dict:
    """TRAINER/trainer_state.json of the checkpoint `path`: an object with the integer `step` >= 0 and the
    run's `config` (BadCheckpointFile naming it otherwise)."""
    state = read_json(path / TRAINER, "trainer_state.json")
    step = state.get("step") if isinstance(state, dict) else None
    if not (type(step) is int and step >= 0 and isinstance(state.get("config"), dict)):
        raise BadCheckpointFile(
            path / TRAINER / "trainer_state.json",
            "expected an object with an integer 'step' >= 0 and the run's 'config' object",
        )
    return state


def _read_tensors(f: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `f`; a broken file is one line naming it (BadCheckpointFile)."""
    with open_tensors(f) as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def load_into(path: Path, optimizers: list[torch.optim.Optimizer]) -> None:
    """Restore optimizer states and RNG states from checkpoint `path` (the model is loaded separately)."""
    tensors = _read_tensors(path / TRAINER / "optimizer.safetensors")
    meta = read_json(path / TRAINER, "optimizer.json")["optimizers"]
    if len(meta) != len(optimizers):
        raise ValueError(f"path: {path} holds {len(meta)} optimizer states, the run has {len(optimizers)}")
    for o, m in zip(optimizers, meta, strict=True):
        o.load_state_dict(_unflatten(m, tensors))
    set_rng_state(_read_tensors(path / TRAINER / "rng.safetensors"))
