"""Instrumentation: how many bytes an adapter materialises out of a key cache.

`CacheCopies(cache)` is a TorchDispatchMode that follows the cache's storage: every op that reads a
tensor living in a followed storage and writes a new storage (index_select, contiguous, cat, ...)
is counted, and its output is followed in turn, so a copy of a copy counts too. Views share their
base's storage and cost nothing. The emulated operator itself runs outside the mode (what the
operator reads is not a copy the adapter made); `received` keeps the arguments it was given.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class CacheCopies(TorchDispatchMode):
    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.followed = {_storage(cache)}
        self.bytes = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel()]
        if any(_storage(t) in self.followed for t in ins):
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.numel() and _storage(o) not in self.followed:
                    self.followed.add(_storage(o))
                    self.bytes += o.numel() * o.element_size()
                    self.ops[str(func.overloadpacket)] += 1
        return out


def record_operator(provider, op: str, received: list[dict[str, Any]]):
    """Wrap provider.module.<op> so each call's arguments are kept and the operator runs outside any
    dispatch mode. Returns the original (for monkeypatch)."""
    orig = getattr(provider.module, op)

    @functools.wraps(orig)
    def wrapped(*args, **kwargs):
        received.append({"args": args, "kwargs": kwargs})
        with _disable_current_modes():
            return orig(*args, **kwargs)

    return wrapped
