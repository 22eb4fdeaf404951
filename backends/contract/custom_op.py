"""What every `torch.ops.glm5.<op>` custom op runs on (backends/contract/torch_op.py registers them): the
registry of live backend instances the ops reach by key, the no-aliasing rule for outputs, and the call of a
backend's declared backward (`OpImpl.backward`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

NAMESPACE = "glm5"

#: key -> a live `backends.interface.Backend` (typed Any: this module sits below the interface)
_live: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def register_instance(backend: Any) -> str:
    """The key custom ops use to reach this backend instance (held weakly)."""
    key = f"{backend.name}@{id(backend):x}"
    with _live_lock:
        _live[key] = backend
    return key


def instance(key: str) -> Any:
    be = _live.get(key)
    if be is None:
        raise RuntimeError(f"backend instance {key!r} no longer exists (a graph outlived its backend?)")
    return be


def _storages(ts: Sequence[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts if isinstance(t, Tensor) and t.numel()}


def no_alias(result: Any, inputs: dict[str, Any]) -> Any:
    """Custom-op outputs may not alias inputs (functionalization relies on it): copy any that do."""
    outs = result if isinstance(result, tuple) else (result,)
    ins = _storages(list(inputs.values()))
    fixed = tuple(
        o.clone() if isinstance(o, Tensor) and o.numel() and _storages([o]) & ins else o for o in outs
    )
    return fixed if isinstance(result, tuple) else fixed[0]


def _run(key: str, op: str, args: dict[str, Any]) -> Any:
    return no_alias(instance(key).run(op, args), args)


def run_backward(key: str, op: str, args: dict[str, Any], outputs: tuple, grad_outputs: tuple) -> tuple:
    """The gradients of `op` (one per `OPS[op].grad_args`) by the backend's declared backward, from the
    forward's saved outputs; none aliases an input, an output or an output gradient."""
    grads = instance(key).run_backward(op, args, outputs, grad_outputs)
    seen = {**args, **{f"out{i}": o for i, o in enumerate(outputs)}}
    return no_alias(tuple(grads), {**seen, **{f"grad{i}": g for i, g in enumerate(grad_outputs)}})
