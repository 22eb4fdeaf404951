"""Activation memory per decoder layer, applied from outside the model: recompute or offload what autograd
saves for the backward.

- `recompute`: each layer runs under `torch.utils.checkpoint` (non-reentrant); the forward keeps only
  the layer's inputs and the backward runs the layer again. Forward hooks fire again during that
  recomputation: training-signal hooks (glm5/train/loop/dsa.py) skip it by asking `recomputing()`.
- `offload`: the activations a layer saves go to host memory as the forward makes them and come back
  when the backward needs them (GLM-5's activation offloading): pinned memory copied asynchronously
  from an accelerator, and on a CPU-only host a copy in a separate allocation, so the same bookkeeping
  runs and is tested. Parameters and buffers the ops save are left in place (they live anyway).

`checkpoint_layers(model, mode)` wraps `forward` (and `predict` of the MTP layers) of every layer in
`model.model.layers` on the instance, so parameter names, the state dict and the model file are
unchanged; mode 'none' undoes it. Gradients are bitwise those of the plain run (tested for the reference
and cpu backends).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "recompute", "offload")
_WRAPPED = ("forward", "predict")  # predict: an MTP layer's entry, which calls DecoderLayer.forward itself
_state = threading.local()


@dataclass
class LayerActivations:
    """What one layer's wrapper did since `checkpoint_layers` (counts over every call)."""

    calls: int = 0  # forwards that saved activations (grad enabled)
    recomputes: int = 0  # recompute mode: backward recomputations
    kept_input_bytes: int = 0  # recompute mode: the tensor arguments the checkpoint keeps instead
    offloaded_tensors: int = 0  # offload mode: distinct activations copied to host memory
    offloaded_bytes: int = 0
    restored_tensors: int = 0  # offload mode: of those, copies the backward has read back
    restored_bytes: int = 0


def recomputing() -> bool:
    """True while a checkpointed layer is being recomputed for the backward (its forward hooks fire
    again then; a hook that records a training signal should skip that second pass)."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _recompute_scope(stats: LayerActivations) -> Iterator[None]:
    previous = recomputing()
    _state.recomputing = True
    stats.recomputes += 1
    try:
        yield
    finally:
        _state.recomputing = previous


def checkpoint_layers(
    model: nn.Module, mode: str, pin_memory: bool | None = None
) -> dict[int, LayerActivations]:
    """Apply `mode` ('none' | 'recompute' | 'offload') to every decoder layer (main and MTP) of a
    GLM5ForCausalLM -> each layer's bookkeeping by layer index (empty for 'none').

    pin_memory (offload): page-locked host copies, made and read back asynchronously; default: when an
    accelerator is available. Calling again replaces the previous mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    stats: dict[int, LayerActivations] = {}
    for i, layer in enumerate(model.model.layers):
        for name in _WRAPPED:
            layer.__dict__.pop(name, None)  # back to the class's method
        layer.__dict__.pop("activations", None)
        if mode == "none":
            continue
        stats[i] = layer.activations = LayerActivations()
        for name in _WRAPPED:
            if hasattr(type(layer), name):
                # a bound method, not a closure: deepcopy rebinds it to the copied layer
                setattr(layer, name, MethodType(partial(_call, mode, name, pin_memory), layer))
    return stats


def _call(mode: str, name: str, pin_memory: bool, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fn = getattr(type(layer), name).__get__(layer)
    if not torch.is_grad_enabled():  # nothing is saved: evaluation, generation
        return fn(*args, **kwargs)
    stats: LayerActivations = layer.activations
    stats.calls += 1
    if mode == "recompute":
        kept = [a for a in args if isinstance(a, torch.Tensor)]
        stats.kept_input_bytes += sum(a.numel() * a.element_size() for a in kept)
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), _recompute_scope(stats)),
            **kwargs,
        )
    pack, unpack, originals = _offload_hooks(layer, stats, pin_memory)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args, **kwargs)
    finally:
        originals.clear()  # autograd keeps the pack hook with every saved tensor: drop what it holds


@dataclass
class _Offloaded:
    device: torch.device  # where the backward wants it
    host: torch.Tensor
    restored: bool = False


def _offload_hooks(layer: nn.Module, stats: LayerActivations, pin_memory: bool):
    """(pack, unpack, originals) for one call of `layer`: each distinct saved activation is copied to host
    memory once, however many ops save it. `originals` holds the device tensors until the call returns
    (the caller clears it), so an address freed and reused inside the call cannot alias an earlier copy."""
    resident = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    copies: dict[tuple, tuple[torch.Tensor, _Offloaded]] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() in resident:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        if key not in copies:
            if pin_memory and t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
            else:
                host = t.detach().to("cpu", copy=True)
            copies[key] = (t, _Offloaded(t.device, host))
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += host.numel() * host.element_size()
        return copies[key][1]

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if not packed.restored:  # an activation two ops saved is one copy, restored (counted) once
            packed.restored = True
            stats.restored_tensors += 1
            stats.restored_bytes += packed.host.numel() * packed.host.element_size()
        host = packed.host
        return host if packed.device.type == "cpu" else host.to(packed.device, non_blocking=pin_memory)

    return pack, unpack, copies
