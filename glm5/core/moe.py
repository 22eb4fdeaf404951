"""Mixture of experts: sigmoid router in fp32 (`noaux_tc`), group-limited choice, routed experts through
the backend's `grouped_matmul`, one shared expert (SPEC 2.3, 2.8, 5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from backends import Backend
from backends.moe import dispatch as moe
from glm5.core.config import GLM5Config
from glm5.core.layers import MLP

if TYPE_CHECKING:
    from glm5.core.attention import Step


class Router(nn.Module):
    """weight [E, D] and e_score_correction_bias [E], both fp32 (GLM-5 runs its router in fp32)."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor, be: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (expert ids int32 [T, top_k], weights fp32 [T, top_k])."""
        t, e = x.shape[0], self.weight.shape[0]
        scores = torch.sigmoid(nn.functional.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()  # the bias steers choice, never the weights
        if self.n_group > 1:
            per = e // self.n_group
            top2, _ = be.topk(choice.reshape(t * self.n_group, per), min(2, per))
            group_score = top2.reshape(t, self.n_group, -1).sum(-1)  # [T, G]
            _, groups = be.topk(group_score, self.topk_group)
            keep = torch.zeros(t, self.n_group, dtype=torch.bool, device=x.device)
            keep.scatter_(1, groups.long(), True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        # deterministic top-k: the same experts on every backend and batch size (SPEC 2.3)
        _, ids = be.topk(choice, self.top_k)
        w = scores.gather(1, ids.long())
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.scale


class Experts(nn.Module):
    """Routed experts stacked for grouped GEMM: gate_proj/up_proj [E, I, D], down_proj [E, D, I].
    Checkpoints store them per expert (`experts.{e}.gate_proj.weight`); glm5/core/checkpoint.py converts."""

    def __init__(self, n: int, hidden: int, inter: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, inter, hidden, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(n, inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter, dtype=dtype))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, be: Backend) -> torch.Tensor:
        """x [T, D], ids int32 [T, k], w fp32 [T, k] -> sum_j w[t, j] * expert_{ids[t, j]}(x[t])  [T, D]."""
        d = moe.dispatch(ids, self.gate_proj.shape[0])
        return moe.combine(self.rows(x, d, be), w, d).to(x.dtype)

    def rows(self, x: torch.Tensor, d: moe.Dispatch, be: Backend) -> torch.Tensor:
        """The expert output of every (token, slot) pair, in d's expert-sorted order: [T*k, D]. Every
        experts module (float, quantized) has this, so expert parallelism wraps any of them."""
        xs = x[d.token]
        gate_up = torch.cat(
            (
                be.grouped_matmul(xs, self.gate_proj, d.offsets),
                be.grouped_matmul(xs, self.up_proj, d.offsets),
            ),
            1,
        )
        h = be.silu_and_mul(gate_up)  # SPEC 2.10: silu(gate) * up in fp32, rounded once
        return be.grouped_matmul(h, self.down_proj, d.offsets)


class MoE(nn.Module):
    def __init__(self, cfg: GLM5Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D] -> [T, D], on the step's backend (`Step`: the one channel the model reaches it by)."""
        be = step.backend
        ids, w = self.gate(x, be)
        out = self.experts(x, ids, w, be)
        return out if self.shared_experts is None else out + self.shared_experts(x, step)
