"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), in safetensors (no pickle: DCP's
Hugging Face storage keeps each rank's shard offsets in the safetensors header, not in a pickled
.metadata file):

    DIR/checkpoints/step-000200/  config.json, manifest.json (each file's size and sha256, every tensor's
                                                 shape and dtype: glm5/train/distributed/manifest.py)
      model/shard-0000R-model-00001-of-00001.safetensors     (each rank's shards of the model)
      trainer/optim/shard-...safetensors, trainer/optimizer.json   (optimizer tensors; the rest in JSON)
      trainer/rng-rankR.safetensors, trainer/trainer_state.json    (per-rank RNG; step, run options, world)

Saved on N ranks, loaded on any number (DCP reshards on load), also by one process without a process
group (`export_hf`). Staging, atomic publish, `latest` and pruning as glm5/train/loop/state.py.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from glm5.core.checkpoint import open_tensors, read_config, read_json
from glm5.core.config import GLM5Config
from glm5.infra import fsio
from glm5.train.distributed.manifest import (
    MANIFEST,
    checkpoint_files,
    file_record,
    manifest_text,
    tensor_specs,
    verify,
)
from glm5.train.distributed.pipeline.run import merged_optimizer_meta
from glm5.train.distributed.pipeline.stages import pipeline_part
from glm5.train.loop.state import LATEST, STAGING, TRAINER, checkpoints, rng_state, set_rng_state

MODEL = "model"
OPTIM = "optim"


def is_sharded(path: Path) -> bool:
    """True for a checkpoint in this module's layout (a `model/` directory of DCP shards)."""
    return (Path(path) / MODEL).is_dir()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _writer(path: Path) -> HuggingFaceStorageWriter:
    return HuggingFaceStorageWriter(str(path), save_distributed=True)


def _unwrap(exc: CheckpointException, path: Path) -> Exception:
    """DCP's CheckpointException (a BaseException holding each rank's error and traceback) as the error it
    wraps: an OSError as is (a full disk: one line naming the file), anything else a ValueError naming
    `path` in one line."""
    errors = [e for e, _ in exc.failures.values()]
    for e in errors:
        if isinstance(e, OSError):
            return e
    first = errors[0] if errors else exc
    return ValueError(f"{path}: {type(first).__name__}: {(str(first).splitlines() or [''])[0]}")


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    with warnings.catch_warnings():  # one process without a process group is this module's intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        try:
            dcp.save(state, storage_writer=_writer(path), no_dist=not dist.is_initialized())
        except CheckpointException as exc:
            raise _unwrap(exc, path) from None


def _load(state: dict[str, torch.Tensor], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        try:
            dcp.load(
                state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized()
            )
        except CheckpointException as exc:
            raise _unwrap(exc, path) from None


def _plan(model: torch.nn.Module) -> dict:
    """name -> ShardInfo of the tensors glm5.parallel.plan split in `model` (empty when it is whole)."""
    return getattr(model, "glm5_plan", None) or {}


def _global(t: torch.Tensor, info, mesh: DeviceMesh | None) -> torch.Tensor:
    """A tensor-parallel slice as a DTensor on `mesh` (sharing its storage), so DCP stores it at its
    offset in the full tensor; on a 2-D mesh's (tp|ep, dp) view, FSDP2's dim-0 shard of such a slice
    (a DTensor over the dp ranks) placed at the plan's offset plus FSDP's; anything else as is (an
    optimizer's 0-d `step` of a split parameter too: the same on every rank, not a slice)."""
    if (
        info is None
        or mesh is None
        or t.dim() != len(info.full_shape)
        or tuple(t.shape) == tuple(info.full_shape)
    ):
        return t
    if isinstance(t, DTensor):
        if mesh.ndim != 2:
            return t
        t, placements = t.to_local(), [Shard(info.dim), Shard(0)]
    else:
        placements = [Shard(info.dim)]
    return DTensor.from_local(
        t,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(info.full_shape),
        stride=torch.empty(info.full_shape, device="meta").stride(),
    )


def _model_state(model: torch.nn.Module, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    plan = _plan(model)
    return {k: _global(v, plan.get(k), mesh) for k, v in get_model_state_dict(model).items()}


def _split_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer state dict as tensors keyed `FQN:NAME` and the rest (JSON)."""
    tensors, state = {}, {}
    for fqn, st in osd["state"].items():
        state[fqn] = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{fqn}:{name}"] = v
                state[fqn][name] = {"__tensor__": f"{fqn}:{name}"}
            else:
                state[fqn][name] = v
    return tensors, {"state": state, "param_groups": osd["param_groups"]}


def save_sharded(
    ckpt_root: Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list,
    trainer: dict,
    keep: int = 2,
    mesh: DeviceMesh | None = None,
) -> Path:
    """Every rank calls it: checkpoint `step-{step:06d}` written into a staging directory (rank 0 makes
    it, every rank writes its shards), published atomically by rank 0, `latest` re-pointed, the newest
    `keep` checkpoints kept. `mesh`: the plan's mesh of a model split by glm5.parallel.plan (1-D, or
    the (tp|ep, dp) view of a 2-D mesh: `Dist.plan_mesh`)."""
    rank, name = _rank(), f"step-{step:06d}"
    box: list[Any] = [fsio.staging_dir(ckpt_root, STAGING) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)  # the staging path, between this run's own processes
    staging: Path = box[0]
    final = ckpt_root / name
    try:
        d = staging / name
        tensors, meta = _split_optimizer(get_optimizer_state_dict(model, optimizers))
        meta = merged_optimizer_meta(model, meta)  # a pipeline rank's: every rank's, in the model's order
        plan = _plan(model)
        tensors = {k: _global(v, plan.get(k.rsplit(":", 1)[0]), mesh) for k, v in tensors.items()}
        model_state = _model_state(model, mesh)
        _save(model_state, d / MODEL)
        _save(tensors, d / TRAINER / OPTIM)
        fsio.save_tensors(rng_state(), d / TRAINER / f"rng-rank{rank}.safetensors")
        if rank == 0:
            world = dist.get_world_size() if dist.is_initialized() else 1
            fsio.write_text(d / "config.json", json.dumps(model.config.to_dict(), indent=2) + "\n")
            fsio.write_text(d / TRAINER / "optimizer.json", json.dumps(meta, indent=1) + "\n")
            fsio.write_text(
                d / TRAINER / "trainer_state.json",
                json.dumps(dict(trainer, step=step, world=world), indent=2) + "\n",
            )
        _barrier()  # every shard is written before rank 0 lists them
        _write_manifest(d, {"model": tensor_specs(model_state), "optim": tensor_specs(tensors)})
        if rank == 0:
            fsio.publish_dir(d, final, STAGING)
            fsio.point_symlink(ckpt_root / LATEST, name)
            older = sorted((s, p) for s, p in checkpoints(ckpt_root) if s < step)
            for _, old in older[: max(len(older) - (keep - 1), 0)]:
                fsio.remove_dir(old)
        _barrier()
    finally:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _write_manifest(d: Path, specs: dict[str, dict]) -> None:
    """Every rank calls it once the checkpoint `d` is complete: each hashes its share of the files, rank 0
    writes manifest.json (glm5/train/distributed/manifest.py) with every rank's tensors (a pipeline rank saves
    its stage's)."""
    rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    box: list[Any] = [checkpoint_files(d) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    mine = ({n: file_record(d / n) for n in box[0][rank::world]}, specs)
    every: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if rank == 0:
        files = {n: r for f, _ in every for n, r in f.items()}
        tensors = {part: {k: v for _, s in every for k, v in s.get(part, {}).items()} for part in specs}
        fsio.write_text(d / MANIFEST, manifest_text(files, tensors))


def load_model(path: Path, model: torch.nn.Module, mesh: DeviceMesh | None = None) -> None:
    """The model weights of the sharded checkpoint `path` into `model` (sharded or whole)."""
    msd = _model_state(model, mesh)
    _load(msd, Path(path) / MODEL)
    plan, params = _plan(model), dict(model.named_parameters())
    set_model_state_dict(model, {k: _local_slice(v, k, plan, params) for k, v in msd.items()})


def load_trainer(
    path: Path, model: torch.nn.Module, optimizers: list, mesh: DeviceMesh | None = None
) -> None:
    """Optimizer states (resharded to this run's layout) and this rank's RNG state."""
    path = Path(path)
    meta = read_json(path / TRAINER, "optimizer.json")
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("state"), dict)
        and isinstance(meta.get("param_groups"), list)
    ):
        raise ValueError(
            f"path: {path / TRAINER / 'optimizer.json'} is not an optimizer state (expected an "
            "object with 'state' and 'param_groups')"
        )
    params = dict(model.named_parameters())
    elsewhere = getattr(pipeline_part(model), "elsewhere", frozenset())  # other pipeline ranks' parameters
    md = HuggingFaceStorageReader(str(path / TRAINER / OPTIM)).read_metadata().state_dict_metadata
    plan = _plan(model)
    template: dict[str, torch.Tensor] = {}
    for key, info in md.items():
        fqn = key.rsplit(":", 1)[0]
        p = params.get(fqn)
        if p is None and fqn in elsewhere:
            continue
        if p is None:
            raise ValueError(f"path: {path} holds optimizer state of {key!r}, which the model has not")
        full = tuple(plan[fqn].full_shape) if fqn in plan else tuple(p.shape)
        if tuple(info.size) == full and info.properties.dtype == p.dtype:  # the parameter's shape and layout
            template[key] = _global(torch.zeros_like(p), plan.get(fqn), mesh)
        else:
            template[key] = torch.zeros(info.size, dtype=info.properties.dtype)
    _load(template, path / TRAINER / OPTIM)
    state = {
        fqn: {
            k: _local_slice(template[v["__tensor__"]], fqn, plan, params)
            if isinstance(v, dict) and "__tensor__" in v
            else v
            for k, v in st.items()
        }
        for fqn, st in meta["state"].items()
        if fqn not in elsewhere
    }
    # not strict: a parameter that never had a gradient (an indexer in a run without the KL) has no state
    set_optimizer_state_dict(
        model,
        optimizers,
        {"state": state, "param_groups": meta["param_groups"]},
        options=StateDictOptions(strict=False),
    )
    rng = path / TRAINER / f"rng-rank{_rank()}.safetensors"
    if not rng.exists():  # loaded on more ranks than saved: the extra ranks continue rank 0's stream
        rng = path / TRAINER / "rng-rank0.safetensors"
    with open_tensors(fsio.inside(rng.parent, rng.name, "rng state")) as h:
        set_rng_state({k: h.get_tensor(k) for k in h.keys()})


def _local_slice(t: torch.Tensor, fqn: str, plan: dict, params: dict) -> torch.Tensor:
    """The plan's slice as the model holds it: a plain tensor, or (a 2-D mesh) FSDP2's DTensor over the
    dp ranks with this rank's shard of the slice; FSDP DTensors of whole parameters stay as they are."""
    if fqn not in plan or not isinstance(t, DTensor):
        return t
    p = params[fqn]
    if not isinstance(p, DTensor):
        return t.to_local()
    return DTensor.from_local(
        t.to_local(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def empty_model(path: Path, backend: str | None = None) -> torch.nn.Module:
    """A GLM5ForCausalLM of the sharded checkpoint `path`'s config, its weights not loaded yet."""
    from glm5.core.model import GLM5ForCausalLM

    return GLM5ForCausalLM(GLM5Config.from_dict(read_config(Path(path))), backend=backend)


def model_from(path: Path, backend: str | None = None) -> torch.nn.Module:
    """A whole (unsharded) GLM5ForCausalLM with the weights of the sharded checkpoint `path`, verified
    against its manifest first."""
    verify(path, trainer=False)
    model = empty_model(path, backend)
    load_model(path, model)
    return model


def export_hf(src: Path, out: Path) -> None:
    """The sharded checkpoint `src` as a Hugging Face directory `out` (config.json + safetensors, the
    layout from_pretrained reads), written in a staging directory and published atomically."""
    model = model_from(src)
    staging = fsio.staging_dir(out.parent, f".{out.name}{STAGING}")
    try:
        model.save_pretrained(staging / out.name)
        fsio.publish_dir(staging / out.name, out, f".{out.name}{STAGING}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_hf(src: Path, out: Path) -> None:
    """A Hugging Face directory `src` as a sharded checkpoint `out` (config.json + model/): what a
    distributed run starts from with --model."""
    from glm5.core.model import GLM5ForCausalLM

    model = GLM5ForCausalLM.from_pretrained(src)
    staging = fsio.staging_dir(out.parent, f".{out.name}{STAGING}")
    try:
        d = staging / out.name
        state = get_model_state_dict(model)
        _save(state, d / MODEL)
        fsio.write_text(d / "config.json", json.dumps(model.config.to_dict(), indent=2) + "\n")
        _write_manifest(d, {"model": tensor_specs(state)})
        fsio.publish_dir(d, out, f".{out.name}{STAGING}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
