"""Weights laid out once (`Backend.prepare`, vllm-ascend's `process_weights_after_loading`).

A prepared weight keeps the contract's logical shape, dtype and values; only its storage differs:
- K-major storage (`k_major`): the operators take [K, N] (npu_quant_matmul's x2) or [E, K, N]
  (npu_grouped_matmul's weight), so the weight is stored transposed once and the adapter's `.T` /
  `.transpose(1, 2)` is already contiguous;
- a derived form kept beside it (`Forms`): the int32 int4 repack npu_grouped_matmul wants, or the
  65535-column blocks of a wide W8A8 weight, keyed on the prepared tensors.
An adapter handed an unprepared weight re-lays it out for that call and counts it in
`provider.relayouts[op]` (the backend's `relayouts`), so a model that forgot `prepare` shows up.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


def k_major(w: torch.Tensor) -> torch.Tensor:
    """Same logical [..., N, K] tensor, stored so that `w.transpose(-1, -2)` is contiguous."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class Forms:
    """Derived forms of prepared weights, keyed on the tensors they were derived from.

    A hit needs the same storage, shape and strides (the custom op hands the adapter detached aliases,
    not the objects `prepare` returned), tensors `prepare` returned still alive (their storage cannot
    be reused while they are) and unchanged version counters (an in-place edit invalidates the form)."""

    def __init__(self) -> None:
        self._forms: dict[tuple, tuple[list, list[int], Any]] = {}
        self._lock = threading.Lock()

    def put(self, tensors: tuple[torch.Tensor, ...], form: Any) -> None:
        key = tuple(_key(t) for t in tensors)
        drop = lambda _ref, k=key: self._forms.pop(k, None)  # noqa: E731
        refs = [weakref.ref(t, drop) for t in tensors]
        with self._lock:
            self._forms[key] = (refs, [t._version for t in tensors], form)

    def get(self, tensors: tuple[torch.Tensor, ...]) -> Any | None:
        entry = self._forms.get(tuple(_key(t) for t in tensors))
        if entry is None:
            return None
        refs, versions, form = entry
        if any(r() is None for r in refs) or [t._version for t in tensors] != versions:
            return None
        return form

    def __len__(self) -> int:
        return len(self._forms)
