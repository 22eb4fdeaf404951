"""Symmetric weight quantizers: int8 per channel, int4 per channel or per group (K-axis groups).

Two scale conventions exist in the wild (docs/quantization.md):
  "qmax"       scale = absmax / (2^(b-1) - 1)    /127, /7    msModelSlim, vLLM runtime, QQQ
  "half_range" scale = absmax / ((qmax-qmin)/2)  /127.5, /7.5 compressed-tensors, torchao
Either way q = clamp(round_half_even(w / scale), -2^(b-1), 2^(b-1) - 1): -128 / -8 are legal
(half_range produces them, and SSZ can shrink a scale below absmax / 7). The formats store whatever
integers and scales the quantizer chose, so the convention is a recipe choice, not a format property.

Shapes: w [N, K] float; scale fp32 [N, G] with G = K // group_size (G = 1 per channel).
"""

from __future__ import annotations

import torch

CONVENTIONS = ("qmax", "half_range")
_EPS = torch.finfo(torch.float32).eps


def qrange(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _divisor(bits: int, convention: str) -> float:
    lo, hi = qrange(bits)
    if convention == "qmax":
        return float(hi)
    if convention == "half_range":
        return (hi - lo) / 2
    raise ValueError(f"convention: expected one of {list(CONVENTIONS)}, got {convention!r}")


def _groups(w: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    """w [N, K] -> fp32 [N, G, gs] and G."""
    n, k = w.shape
    gs = k if not group_size else group_size
    if gs < 1 or k % gs:
        raise ValueError(f"group_size: expected a divisor of K={k} (0/None: per channel), got {group_size}")
    return w.float().reshape(n, k // gs, gs), k // gs


def round_to_int(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """w [N, K] float, scale [N, G] fp32 -> int8 [N, K]: clamp(round_half_even(w / scale))."""
    n, k = w.shape
    wg = w.float().reshape(n, scale.shape[1], -1)
    lo, hi = qrange(bits)
    return torch.round(wg / scale[..., None]).clamp(lo, hi).to(torch.int8).reshape(n, k)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (int4 or int8 values), scale [N, G] -> fp32 [N, K]."""
    n, k = q.shape
    return (q.float().reshape(n, scale.shape[1], -1) * scale[..., None]).reshape(n, k)


def minmax_scale(
    w: torch.Tensor, bits: int, group_size: int | None = None, convention: str = "qmax"
) -> torch.Tensor:
    """Symmetric absmax scale fp32 [N, G] of w [N, K], floored at fp32 eps."""
    wg, _ = _groups(w, group_size)
    return (wg.abs().amax(-1) / _divisor(bits, convention)).clamp_min(_EPS)


def quantize_weight(
    w: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    convention: str = "qmax",
    method: str = "minmax",
    ssz_steps: int = 10,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N, G]) by minmax, or minmax refined by SSZ."""
    scale = minmax_scale(w, bits, group_size, convention)
    if method == "ssz":
        scale = ssz_refine(w, scale, bits, ssz_steps)
    elif method != "minmax":
        raise ValueError(f"method: expected 'minmax' or 'ssz' (GPTQ lives in quant.gptq), got {method!r}")
    return round_to_int(w, scale, bits), scale


def ssz_refine(w: torch.Tensor, scale: torch.Tensor, bits: int, steps: int) -> torch.Tensor:
    """msModelSlim SSZ (quant.md 4.4): per row-group least squares s = sum(w q) / sum(q^2) on the current
    integers, requantize, keep the new s only where the squared error dropped; stop when nothing
    improves by more than 1e-10. Returns the refined scale fp32 [N, G]."""
    n, k = w.shape
    wg = w.float().reshape(n, scale.shape[1], -1)
    lo, hi = qrange(bits)

    def err(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round(wg / s[..., None]).clamp(lo, hi)
        return (wg - q * s[..., None]).pow(2).sum(-1), q

    best, q = err(scale)
    for _ in range(steps):
        qq = q.pow(2).sum(-1)
        cand = torch.where(qq > 0, (wg * q).sum(-1) / qq.clamp_min(1), scale).clamp_min(_EPS)
        e, q_new = err(cand)
        better = e < best - 1e-10
        if not bool(better.any()):
            break
        scale = torch.where(better, cand, scale)
        best = torch.where(better, e, best)
        q = torch.where(better[..., None], q_new, q)
    return scale
