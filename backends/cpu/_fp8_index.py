"""The FP8 indexer's keys and scores on the cpu backend (SPEC 7.4 / 7.5).

A request's e4m3 keys are read through the layout and decoded once (the reference re-casts them for
every block of queries). `exact_scores` is the reference's `fp8_score_block` itself, on the reference's
blocks: the head dots are exact in fp64 whatever computes them, but the head-weighted fp64 sum is not, so
only the same call on the same shapes gives the fp32 logits, and every top-k order taken from them, bit for
bit on every CPU.
"""

from __future__ import annotations

import torch

from backends.cpu._cache import keys_of_request
from backends.cpu._fp8 import decode
from backends.layout import SeqLayout
from backends.reference.fp8_indexer_logits import fp8_score_block

#: keys decoded per slice (int16 / fp64 temporaries of a few MiB)
DECODE_ROWS = 4096


def request_keys(
    k_cache: torch.Tensor, k_scale: torch.Tensor, layout: SeqLayout, b: int, s: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys 0..s-1 of request b decoded to `dtype` [s, D_I] (contiguous) and their scales [s] fp32."""
    codes = keys_of_request(k_cache, layout, b, s)
    scales = keys_of_request(k_scale.unsqueeze(-1), layout, b, s)[:, 0].float()
    keys = torch.empty(s, codes.shape[-1], dtype=dtype)
    for r0 in range(0, s, DECODE_ROWS):
        decode(codes[r0 : r0 + DECODE_ROWS], dtype, out=keys[r0 : r0 + DECODE_ROWS])
    return keys, scales


def exact_scores(
    q: torch.Tensor, keys64: torch.Tensor, ks: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """q e4m3 [tq, H_I, D_I], keys64 fp64 [s, D_I], ks fp32 [s], weights [tq, H_I] -> fp32 [tq, s], no
    mask: the reference's own `fp8_score_block` (the fp64 head sum is not exact, so only the same call
    gives the same rounding on every CPU; its `keys.double()` is a no-op on the decoded keys)."""
    return fp8_score_block(q, keys64, ks, weights)
