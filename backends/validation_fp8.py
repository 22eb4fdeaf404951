"""Input validation of the FP8 ops (SPEC 7), in the tiers of `backends.validation`: a ValueError naming
the argument, what was expected and what came. `check_<op>`: shapes, dtypes, devices, Python scalars,
every call, no tensor values read; `values_<op>`: checks that read values (GLM5_VALIDATE=values), and
layouts are value-checked once per SeqLayout (`SeqLayout.check`)."""

from __future__ import annotations

import torch

from backends.validation import (  # noqa: F401  (MLA_*: the FlashMLA row's widths, re-exported)
    FLOAT_DTYPES,
    MLA_D_QK,
    MLA_D_V,
    MLA_ROW_BYTES,
    _shape,
    check_cache,
    check_heads,
    check_layout,
    check_same_device,
    check_tensor,
    check_topk_width,
    fail,
)

E4M3 = torch.float8_e4m3fn
BLOCK = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        fail("out_dtype", "one of torch.float32, torch.float16, torch.bfloat16", out_dtype)
