"""Muon with Muon Split (GLM-5), plus the parameter split between Muon and AdamW.

Muon replaces each matrix update by the orthogonalised momentum (Newton-Schulz, the quintic iteration
of Keller Jordan's Muon) scaled by `0.2 * sqrt(max(m, n))`, which gives the update the RMS of a typical
AdamW update so both optimizers share one learning rate (Moonlight, arXiv 2502.16982).

Muon Split (GLM-5 report): the MLA up-projections hold one small matrix per attention head, so they are
orthogonalised per head rather than as one tall matrix: `q_b_proj [H*(n+r), q_lora]` as H blocks W_UQ_h,
`kv_b_proj [H*(n+v), c]` as H blocks W_UK_h and H blocks W_UV_h. Routed experts, stacked
`[E, rows, cols]`, are always orthogonalised per expert (they are E separate matrices).
AdamW takes the embedding, the output head, norms and biases (every parameter with fewer than 2 dims).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MODES = ("muon-split", "muon", "adamw")


def zeropower_via_newtonschulz(
    g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of g [..., m, n]: U S' V^T with S' ~ 1 (0.5 .. 1.5).

    Normalising by the Frobenius norm bounds the spectral norm by 1, where the quintic iteration
    X <- a X + (b A + c A^2) X, A = X X^T, converges. Works on the short side (m <= n) so A is small.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).to(g.dtype)


@dataclass(frozen=True)
class Blocks:
    """How Muon views a parameter: `[heads, sum(sections), cols]`, each section of rows orthogonalised
    separately per head. A plain matrix is Blocks(1, (rows,))."""

    heads: int
    sections: tuple[int, ...]


class Muon(torch.optim.Optimizer):
    """Muon over parameters that each carry a `Blocks` view (given per group as `blocks`, a list aligned
    with `params`). Momentum is an EMA with Nesterov look-ahead, decoupled weight decay, as torch.optim.Muon.
    """

    def __init__(
        self,
        params: Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps
        )
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p, blk in zip(group["params"], group["blocks"], strict=True):
                rows = p.shape[0] if p.dim() == 2 else p.shape[-2]
                lead = 1 if p.dim() == 2 else math.prod(p.shape[:-2])
                if p.dim() < 2 or blk.heads * sum(blk.sections) != rows * lead:
                    raise ValueError(f"blocks: {blk} does not tile a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim API
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p, blk in zip(group["params"], group["blocks"], strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                u = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                p.mul_(1 - lr * wd)
                p.add_(self.update(u, blk, group["ns_steps"]), alpha=-lr)

    def state_dict(self) -> dict:
        """As torch's, without the `blocks` views (derived from the model, and not JSON data)."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g.pop("blocks", None)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        views = [g["blocks"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, blocks in zip(self.param_groups, views, strict=True):
            g["blocks"] = blocks

    def update(self, u: torch.Tensor, blk: Blocks, ns_steps: int) -> torch.Tensor:
        """The scaled orthogonalised update of one parameter (same shape as u)."""
        cols = u.shape[-1]
        v = u.reshape(blk.heads, sum(blk.sections), cols)
        out = torch.empty_like(v)
        start = 0
        for rows in blk.sections:
            block = v[:, start : start + rows]  # [heads, rows, cols]: one matrix per head
            o = zeropower_via_newtonschulz(block, ns_steps, dtype=self.ns_dtype)
            out[:, start : start + rows] = o * (0.2 * math.sqrt(max(rows, cols)))
            start += rows
        return out.view_as(u)


def blocks_for(name: str, p: torch.Tensor, config, split: bool) -> Blocks:
    """The Muon view of parameter `name` (GLM-5 names) under Muon Split (`split`) or whole-matrix Muon."""
    if split and name.endswith("self_attn.q_b_proj.weight"):  # heads from the rows: a tensor-parallel
        return Blocks(p.shape[0] // config.qk_head_dim, (config.qk_head_dim,))  # shard holds whole heads
    if split and name.endswith("self_attn.kv_b_proj.weight"):
        per_head = (config.qk_nope_head_dim, config.v_head_dim)  # W_UK_h, W_UV_h
        return Blocks(p.shape[0] // sum(per_head), per_head)
    if p.dim() == 3:
        return Blocks(p.shape[0], (p.shape[1],))  # stacked routed experts: one matrix each
    return Blocks(1, (p.shape[0],))


def uses_adamw(name: str, p: torch.Tensor) -> bool:
    """Embedding, output head, norms and biases stay on AdamW (Moonlight, GLM-5)."""
    return p.dim() < 2 or name in ("model.embed_tokens.weight", "lm_head.weight")


def build_optimizers(
    model: nn.Module,
    mode: str = "muon-split",
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.95,
    muon_cls: type[Muon] | None = None,
    full_shape: Callable[[torch.Tensor], tuple[int, ...]] | None = None,
) -> list[torch.optim.Optimizer]:
    """[Muon, AdamW] (or [AdamW] for mode 'adamw') over the trainable parameters of a GLM-5 model.

    A sharded model passes its Muon (`muon_cls`, e.g. DistributedMuon) and `full_shape`, the shape of
    the whole parameter a shard belongs to: the Blocks views are of whole parameters."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    muon_p, muon_b, adam_p = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if mode == "adamw" or uses_adamw(name, p):
            adam_p.append(p)
        else:
            whole = p if full_shape is None else torch.empty(full_shape(p), device="meta")
            muon_p.append(p)
            muon_b.append(blocks_for(name, whole, model.config, split=mode == "muon-split"))
    opts: list[torch.optim.Optimizer] = []
    if muon_p:
        opts.append(
            (muon_cls or Muon)(
                [{"params": muon_p, "blocks": muon_b}],
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
            )
        )
    if adam_p:
        # foreach=False: one kernel per tensor, the same summation order on every run
        opts.append(torch.optim.AdamW(adam_p, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False))
    return opts
