"""dayone backend: grouped_matmul (SPEC 2.8), float only; the int8 and int4 variants are not ported (and
not borrowed: a quantized model is declined with the dtype reason until they are)."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], w.shape[1], dtype=out_dtype or x.dtype)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        if offs[e] < offs[e + 1]:
            rows = slice(offs[e], offs[e + 1])
            # fp64: a row's result must not depend on how many rows share its expert (SPEC 2.8)
            out[rows] = (x[rows].double() @ w[e].double().T).to(out.dtype)
    return out


IMPL = OpImpl(grouped_matmul, OpCaps(dtypes=("float32", "bfloat16", "float16")))
