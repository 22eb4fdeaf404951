"""Top-k agreement across a tensor-parallel group (GLM5_VALIDATE=topk; also on under values and reference).

Every tensor-parallel rank runs the replicated indexer on the same input and must pick the same keys:
nothing exchanges the top-k, so agreement rests on bitwise-identical inputs and a deterministic top-k
(vLLM #53691, #55872). This check turns that hope into a test: per step each layer's int32 top-k is
reduced on device to one int64 digest (a position-weighted sum, exact in integer arithmetic), the
[layers] digests are all-gathered across the group once, and the first layer whose digest differs
between ranks raises `TopkDisagreement` naming the layer and the step. One host read per step, none
per layer.
"""

from __future__ import annotations

import torch

from backends.interface import validation_mode
from glm5.parallel.group import Group

#: GLM5_VALIDATE modes that turn the check on ("topk" alone costs one small all-gather per step)
MODES = ("topk", "values", "reference")

_MULT = 2654435761  # Knuth's multiplicative hash: distinct weights per position, so a permutation shows
_MOD = (1 << 31) - 1


class TopkDisagreement(RuntimeError):
    """The ranks of a tensor-parallel group selected different keys in some layer."""


def enabled() -> bool:
    return validation_mode() in MODES


def digest(topk: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer top-k [T, k] int32 -> int64 [layers]: sum_i (topk_i + 2) * w_i with w_i a hash of the
    flat position i (the +2 keeps -1 padding from weighing zero); computed on the tensors' device."""
    out = []
    for t in topk:
        v = t.reshape(-1).to(torch.int64) + 2
        w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) * _MULT % _MOD + 1
        out.append((v * w).sum() + v.numel())
    return torch.stack(out)


class TopkAgreement:
    """Checks one group's top-k per step; `step` counts the calls (the forward steps of one engine)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.step = 0

    def check(self, topk: list[torch.Tensor]) -> None:
        step, self.step = self.step, self.step + 1
        if self.group.size == 1 or not topk:
            return
        every = self.group.all_gather(digest(topk)[None], dim=0)  # [ranks, layers]
        differs = (every != every[:1]).any(0)
        if not bool(differs.any()):  # the one host read of the step
            return
        layer = int(differs.nonzero()[0, 0])
        ranks = [r for r in range(self.group.size) if bool(every[r, layer] != every[0, layer])]
        raise TopkDisagreement(
            f"top-k agreement: layer {layer} selected different keys on tensor-parallel rank(s) {ranks} "
            f"than on rank 0 at step {step} (GLM5_VALIDATE={validation_mode()}; the replicated indexer "
            f"must see bitwise-identical inputs on every rank)"
        )
