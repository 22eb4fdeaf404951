"""Plain-torch building blocks: RMSNorm, rotary embedding (interleaved or half-split), SwiGLU MLP (its
activation through the backend's `silu_and_mul`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from backends.invariant import engine as invariant

if TYPE_CHECKING:
    from glm5.core.attention import Step


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (x: [..., D])."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim // 2] fp32 for int positions [T] (plain RoPE, no scaling). In the layout-invariant
    mode the angles are exact integer turns, with no fp64 (SPEC 12: `rope_cos_sin`)."""
    if invariant.active():
        return invariant.rope_cos_sin(positions, dim, theta)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., r] by cos/sin [T, r/2] in fp32; cast back.

    interleaved (GPT-J, GLM-5 attention and indexer): pairs (x[2i], x[2i+1]);
    half-split (NeoX, DeepSeek-V3.2's fixed indexer): pairs (x[i], x[i + r/2]).
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the dense layers and the shared expert. The activation is the
    step's backend's `silu_and_mul` (SPEC 2.10) on [gate(x) | up(x)]: in fp32, rounded once."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [..., D] -> [..., D], on the step's backend (`Step`: the one channel the model reaches it by)."""
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        h = step.backend.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]))
        return self.down_proj(h.reshape(*x.shape[:-1], h.shape[-1]))
