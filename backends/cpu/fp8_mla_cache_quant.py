"""cpu backend: fp8_mla_cache_quant (SPEC 7.6), bit for bit the reference: per 128-wide latent tile the
fp32 amax, the floored power-of-two scale, the saturating e4m3 cast; each part written straight into its
bytes of the 656-byte rows (no intermediate per-column scale tensor), in row slices that stay in cache.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.formats import BLOCK, E4M3, E4M3_MAX, MLA_ROW_BYTES, MLA_SCALE_FLOOR, pow2_ceil

LATENT, ROPE = 512, 64
TILES = LATENT // BLOCK
ROWS = 512  # rows per slice: 1 MiB of fp32 latent


def fp8_mla_cache_quant(kv: torch.Tensor) -> torch.Tensor:
    """kv [N, 576] float -> uint8 [N, 656]. Semantics: backends/reference/fp8_mla_cache_quant.py"""
    n = kv.shape[0]
    rows = torch.empty(n, MLA_ROW_BYTES, dtype=torch.uint8)
    for r0 in range(0, n, ROWS):
        r1 = min(r0 + ROWS, n)
        lat = kv[r0:r1, :LATENT].to(torch.float32, copy=True).view(r1 - r0, TILES, BLOCK)
        amax = lat.abs().amax(dim=-1)
        scale = pow2_ceil(torch.clamp(amax / E4M3_MAX, min=MLA_SCALE_FLOOR))
        codes = lat.div_(scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
        out = rows[r0:r1]
        out[:, :LATENT] = codes.view(r1 - r0, LATENT).view(torch.uint8)
        out[:, LATENT : LATENT + 4 * TILES] = scale.view(torch.uint8)
        rope = kv[r0:r1, LATENT : LATENT + ROPE].to(torch.bfloat16).contiguous()
        out[:, LATENT + 4 * TILES :] = rope.view(torch.uint8)
    return rows


IMPL = OpImpl(fp8_mla_cache_quant, OpCaps(FLOATS))
