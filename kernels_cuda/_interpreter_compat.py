"""Triton 3.5's interpreter vs NumPy >= 2.4: keep dynamic loop bounds working.

The interpreter holds every scalar as a 1-element array and turns it into a Python int with
`int(array)` (`tensor.__index__`), which NumPy 2.4 rejects for arrays with ndim > 0, so any
`for i in range(0, n)` with a runtime bound fails. `apply()` wraps the interpreter's tensor patch to
read the single element instead. Compiled (GPU) kernels never run this code.
"""

from __future__ import annotations

import numpy as np


def _index(self) -> int:
    data = np.asarray(self.handle.data)
    if data.size != 1:
        raise TypeError(f"only single-element tensors can be used as an index, got shape {data.shape}")
    return int(data.reshape(-1)[0])


def apply() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: nothing to patch, the backend reports itself unavailable
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_glm5_compat", False):
        return

    def patch_lang_tensor(tensor, *args, **kwargs) -> None:  # the helper's signature varies by release
        original(tensor, *args, **kwargs)
        tensor.__index__ = _index

    patch_lang_tensor._glm5_compat = True
    interpreter._patch_lang_tensor = patch_lang_tensor
