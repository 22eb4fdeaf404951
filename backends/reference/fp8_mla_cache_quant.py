"""Rows of FlashMLA's V3.2 FP8 latent cache (SPEC 7.6; FlashMLA `tests/quant.py::quantize_k_cache`; the
layout of vLLM's kv_cache_dtype "fp8_ds_mla", whose writer chooses other scales, see below).

kv float [N, 576] (the 512-wide latent c_kv, then the 64 RoPE values k_pe) -> uint8 [N, 656]:
    bytes   0..511: latent[j] as e4m3, e4m3(clamp(latent[j] / scale[j // 128], -448, 448)) RNE
    bytes 512..527: scale[i] fp32 (little endian), scale[i] = 2 ** ceil(log2(max(amax_i / 448, 1e-4)))
                    where amax_i = max |latent[128 i : 128 (i+1)]|  (always a power of two, so every
                    reader's bf16 rounding of the scale is exact)
    bytes 528..655: k_pe as bf16 (not quantized)
Writing into a cache is indexing: `write_rows(cache, slots, rows)` (slots = physical rows).
vLLM's `concat_and_cache_ds_mla` writes this layout with other scales, max(amax_i / 448, FLT_MIN) (no
power of two, no 1e-4 floor), so its bytes differ from these; reading agrees (SPEC 7.7, 7.8).
This module is the op's declaration too (`DECL`: the function below is the signature; validator, fake,
sample).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, _shape, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import FLOATS, dtype_of, randn
from backends.reference.fp8_format import (
    BLOCK,
    E4M3_MAX,
    MLA_LATENT,
    MLA_ROPE,
    MLA_ROW_BYTES,
    MLA_SCALE_FLOOR,
    MLA_TILES,
    cast_e4m3,
    pow2_ceil,
)


@reference_op("fp8_mla_cache_quant")
def fp8_mla_cache_quant(kv: torch.Tensor) -> torch.Tensor:
    """kv [N, 576] float -> uint8 [N, 656]."""
    n = kv.shape[0]  # kv: [N, 576]
    lat = kv[:, :MLA_LATENT].float()
    amax = lat.reshape(n, MLA_TILES, BLOCK).abs().amax(dim=-1)  # [N, 4]
    scale = pow2_ceil(torch.clamp(amax / E4M3_MAX, min=MLA_SCALE_FLOOR))
    codes = cast_e4m3(lat / scale.repeat_interleave(BLOCK, dim=-1))
    rows = torch.empty(n, MLA_ROW_BYTES, dtype=torch.uint8)
    rows[:, :MLA_LATENT] = codes.view(torch.uint8)
    rows[:, MLA_LATENT : MLA_LATENT + 4 * MLA_TILES] = scale.contiguous().view(torch.uint8)
    rope = kv[:, MLA_LATENT : MLA_LATENT + MLA_ROPE].to(torch.bfloat16).contiguous()
    rows[:, MLA_LATENT + 4 * MLA_TILES :] = rope.view(torch.uint8)
    return rows


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store packed rows [N, 656] at physical slots [N] of a ragged [rows, 656] or paged [nb, bs, 656]
    cache (slot = block_id * block_size + offset for a paged one), in place."""
    cache.view(-1, MLA_ROW_BYTES)[slots.to(torch.int64)] = rows.to(cache.device)


def check(kv) -> None:
    check_tensor("kv", kv, dtype=FLOAT_DTYPES, ndim=2)
    if kv.shape[1] != MLA_LATENT + MLA_ROPE:
        fail("kv", f"shape [N, {MLA_LATENT + MLA_ROPE}] (512 latent + 64 RoPE)", f"shape {_shape(kv)}")


DECL = OpDecl(
    name="fp8_mla_cache_quant",
    spec_section="7.6",
    signature=fp8_mla_cache_quant,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("kv"),
    validate=check,
    fake=lambda a: a["kv"].new_empty((a["kv"].shape[0], MLA_ROW_BYTES), dtype=torch.uint8),
    sample=lambda g, dt, grad: dict(kv=randn(g, 3, 576, dtype=dt)),
    sharding="unsplit",
)
IMPL = OpImpl(fp8_mla_cache_quant, OpCaps(FLOATS))
