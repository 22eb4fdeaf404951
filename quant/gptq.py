"""GPTQ (Frantar et al. 2022), in its minimal form.

Columns are quantized in order; each column's rounding error is spread over the not-yet-quantized
columns through the upper Cholesky factor of H^-1, so the layer output X W^T (not W itself) stays
close. H = (2/n) sum X^T X over the calibration inputs of the layer.
"""

from __future__ import annotations

import torch

from quant.quantizers import minmax_scale, qrange


class Hessian:
    """Running H = (2/n) sum_x x x^T for inputs x [*, K] (fp64 so long runs stay accurate)."""

    def __init__(self, k: int) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        m = x.shape[0]
        self.h.mul_(self.n / max(self.n + m, 1)).add_(x.T @ x, alpha=2.0 / max(self.n + m, 1))
        self.n += m


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    convention: str = "qmax",
    block: int = 128,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float, h [K, K] -> (q int8 [N, K], scale fp32 [N, G]).

    Group scales are taken from the error-updated weights at each group boundary when the group fits in
    a block (block % group_size == 0); per-channel scales come from the original weights."""
    n, k = w.shape
    gs = k if not group_size else group_size
    if k % gs:
        raise ValueError(f"group_size: expected a divisor of K={k}, got {group_size}")
    dynamic = gs <= block and block % gs == 0
    lo, hi = qrange(bits)
    W = w.double().clone()
    H = h.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale = torch.zeros(n, k // gs, dtype=torch.float32) if dynamic else minmax_scale(w, bits, gs, convention)
    q = torch.zeros(n, k, dtype=torch.int8)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, dtype=torch.float64)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % gs == 0:
                scale[:, col // gs] = minmax_scale(w1[:, i : i + gs], bits, None, convention)[:, 0]
            s = scale[:, col // gs].double()
            qc = torch.round(w1[:, i] / s).clamp(lo, hi)
            q[:, col] = qc.to(torch.int8)
            e = (w1[:, i] - qc * s) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err[:, i] = e
        W[:, i2:] -= err @ hinv[i1:i2, i2:]
    return q, scale
