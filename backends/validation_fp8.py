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


def check_fp8_mla_cache_quant(kv) -> None:
    check_tensor("kv", kv, dtype=FLOAT_DTYPES, ndim=2)
    if kv.shape[1] != MLA_D_QK:
        fail("kv", f"shape [N, {MLA_D_QK}] (512 latent + 64 RoPE)", f"shape {_shape(kv)}")


def check_fp8_sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse) -> None:
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    t = q.shape[0]
    if q.shape[2] != MLA_D_QK:
        fail("q", f"shape [T, H, {MLA_D_QK}] (FlashMLA V3.2 FP8 cache)", f"shape {_shape(q)}")
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=(2, 3))
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != t:
        fail("indices", f"shape [T={t}, topk]", f"shape {_shape(indices)}")
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    check_layout(layout, t, kv_cache, "kv_cache")
    check_cache("kv_cache", kv_cache, layout, MLA_ROW_BYTES, torch.uint8)
    if (
        isinstance(sm_scale, bool)
        or not isinstance(sm_scale, (int, float))
        or not abs(sm_scale) < float("inf")
    ):
        fail("sm_scale", "a finite float", sm_scale)
    if d_v != MLA_D_V:
        fail("d_v", f"{MLA_D_V} (the latent width of the FP8 cache)", d_v)
    if not isinstance(return_lse, bool):
        fail("return_lse", "a bool", type(return_lse).__name__)


def values_fp8_sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse) -> None:
    layout.check(q.shape[0], kv_cache, "kv_cache")
