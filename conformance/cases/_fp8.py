"""Input builders shared by the FP8 conformance cases (SPEC 7): e4m3 operands made the way a model makes
them (group-quantized activations, block-quantized weights, FP8 indexer inputs, 656-byte cache rows),
from seeded CPU generators. Quantization here is the reference's, so the cases test the ops that
consume FP8 data, and fp8_quant_group / fp8_mla_cache_quant are tested on their own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.layout import SeqLayout
from backends.reference.fp8_format import quantize_weight_blocks
from backends.reference.fp8_indexer_logits import quantize_indexer_inputs
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant
from backends.reference.fp8_quant_group import fp8_quant_group
from conformance.cases._common import kv_layout, randn

NAN_BYTE = 0xFF  # an e4m3 NaN, and NaN fp32 scales / bf16 RoPE values: unused cache rows


def activations(g: torch.Generator, m: int, k: int, *, ue8m0: bool = False, spread: bool = True):
    """(x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)]) from activations whose rows span 1e-3 .. 1e2."""
    x = randn(g, m, k)
    if spread and m:
        x = x * torch.logspace(-3, 2, m)[:, None]
    return fp8_quant_group(x, 128, 1e-4, ue8m0)


def weights(g: torch.Generator, *lead_n_k: int):
    """(w_q e4m3 [..., N, K], w_scale_inv fp32 [..., ceil(N/128), ceil(K/128)])."""
    return quantize_weight_blocks(randn(g, *lead_n_k) * 0.05)


def indexer_inputs(
    g,
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    *,
    h_i=8,
    d_i=128,
    block_size=None,
    plateau: float | None = None,
    weights_sign="mixed",
) -> dict:
    """FP8 indexer arguments: bf16-valued q / k quantized per head vector and per key (UE8M0, as
    DeepSeek-V3.2 and vLLM), the q scale folded into weights; unused cache rows NaN codes / scales."""
    t = sum(q_lens)

    def keys(b, n):
        k = randn(g, n, d_i)
        if plateau is not None:
            k = k.abs()
            dead = torch.rand(n, generator=g) >= plateau
            k[dead] = -k[dead]
        return k

    layout, k_f = kv_layout(g, q_lens, k_lens, d_i, "float32", block_size=block_size, keys=keys)
    q = randn(g, t, h_i, d_i)
    if plateau is not None:
        q = q.abs()
    w = randn(g, t, h_i) if weights_sign == "mixed" else torch.rand(t, h_i, generator=g) + 0.1
    flat = k_f.reshape(-1, d_i)
    live = torch.isfinite(flat).all(dim=1)
    q8, k8_live, ks_live, w8 = quantize_indexer_inputs(q, flat[live], w * (h_i**-0.5 * d_i**-0.5))
    k8 = torch.full(flat.shape, NAN_BYTE, dtype=torch.uint8).view(torch.float8_e4m3fn)
    k8[live] = k8_live
    ks = torch.full(flat.shape[:1], float("nan"))
    ks[live] = ks_live
    return {
        "q": q8,
        "k_cache": k8.reshape(k_f.shape),
        "k_scale": ks.reshape(k_f.shape[:-1]),
        "weights": w8,
        "layout": layout,
    }


def mla_cache(
    g, q_lens: Sequence[int], k_lens: Sequence[int], *, block_size=None
) -> tuple[SeqLayout, torch.Tensor]:
    """A ragged [rows, 656] or paged [nb, bs, 656] FP8 latent cache (FlashMLA decode-test values: randn / 10
    clamped to +-1); every unused byte 0xFF (NaN codes, scales and RoPE)."""
    layout, kv = kv_layout(
        g,
        q_lens,
        k_lens,
        576,
        "float32",
        block_size=block_size,
        keys=lambda b, n: (randn(g, n, 576) / 10).clamp(-1, 1),
    )
    flat = kv.reshape(-1, 576)
    live = torch.isfinite(flat).all(dim=1)
    rows = torch.full((flat.shape[0], 656), NAN_BYTE, dtype=torch.uint8)
    rows[live] = fp8_mla_cache_quant(flat[live].bfloat16())
    return layout, rows.reshape(*kv.shape[:-1], 656)
