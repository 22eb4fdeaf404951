"""What every `torch.ops.glm5.<op>` custom op runs on (backends/library.py registers them): the registry
of live backend instances the ops reach by key, the SeqLayout's trip across the op boundary, the
no-aliasing rule for outputs, and the call of a backend's declared backward (`OpImpl.backward`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from backends.layout import SeqLayout

if TYPE_CHECKING:
    from backends.interface import Backend

NAMESPACE = "glm5"

_live: weakref.WeakValueDictionary[str, Backend] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def register_instance(backend: Backend) -> str:
    """The key custom ops use to reach this backend instance (held weakly)."""
    key = f"{backend.name}@{id(backend):x}"
    with _live_lock:
        _live[key] = backend
    return key


def instance(key: str) -> Backend:
    be = _live.get(key)
    if be is None:
        raise RuntimeError(f"backend instance {key!r} no longer exists (a graph outlived its backend?)")
    return be


def _layout(cu_q: Tensor, seqlens_k: Tensor, cu_k: Tensor | None, bt: Tensor | None, max_k: int) -> SeqLayout:
    return SeqLayout(cu_q, seqlens_k, cu_k, bt, max_k if max_k >= 0 else None, trusted=True)


def layout_args(layout: SeqLayout) -> tuple:
    """A SeqLayout as custom-op arguments: its four tensors and max_seqlen_k (-1 if unknown)."""
    return (*layout.tensors(), -1 if layout.max_seqlen_k is None else layout.max_seqlen_k)


def _storages(ts: Sequence[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts if isinstance(t, Tensor) and t.numel()}


def _fresh(result: Any, inputs: dict[str, Any]) -> Any:
    """Custom-op outputs may not alias inputs (functionalization relies on it): copy any that do."""
    outs = result if isinstance(result, tuple) else (result,)
    ins = _storages(list(inputs.values()))
    fixed = tuple(
        o.clone() if isinstance(o, Tensor) and o.numel() and _storages([o]) & ins else o for o in outs
    )
    return fixed if isinstance(result, tuple) else fixed[0]


def _run(key: str, op: str, args: dict[str, Any]) -> Any:
    return _fresh(instance(key).run(op, args), args)


def run_backward(key: str, op: str, args: dict[str, Any], outputs: tuple, grad_outputs: tuple) -> tuple:
    """The gradients of `op` (one per `OPS[op].grad_args`) by the backend's declared backward, from the
    forward's saved outputs; none aliases an input, an output or an output gradient."""
    grads = instance(key).run_backward(op, args, outputs, grad_outputs)
    seen = {**args, **{f"out{i}": o for i, o in enumerate(outputs)}}
    return _fresh(tuple(grads), {**seen, **{f"grad{i}": g for i, g in enumerate(grad_outputs)}})


def _lib_op(name: str):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


def run_attention(
    op: str,
    backend: str,
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    layout_tensors: tuple,
    sm_scale: float,
    d_v: int,
    return_lse: bool,
) -> tuple[Tensor, Tensor]:
    """The body of the sparse-attention custom ops (bf16 and FP8 caches): lse is an empty [0] float32
    tensor when return_lse is False (a schema has no optional outputs)."""
    layout = _layout(*layout_tensors)
    args = dict(
        q=q,
        kv_cache=kv_cache,
        indices=indices,
        layout=layout,
        sm_scale=sm_scale,
        d_v=d_v,
        return_lse=return_lse,
    )
    out, lse = _run(backend, op, args)
    if not return_lse or lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


def attention_fake(q: Tensor, d_v: int, return_lse: bool) -> tuple[Tensor, Tensor]:
    t, h, _ = q.shape
    return q.new_empty((t, h, d_v)), q.new_empty((t, h) if return_lse else (0,), dtype=torch.float32)
