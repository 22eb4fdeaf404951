"""The output head with its vocabulary split over a group (the plan's 'vocab-head' style)."""

from __future__ import annotations

import torch

from glm5.core.attention import Step
from glm5.core.model import LMHead
from glm5.parallel.group import Group, enter


class VocabParallelHead(LMHead):
    """`lm_head` holding this rank's vocabulary rows. Its forward gives the local logits (the plan's hook
    gathers them); `loss` computes the chunked projection + cross-entropy on the split vocabulary (the
    step's backend's `linear_cross_entropy_shard` per rank), whose log-sum-exp is combined over the
    group, so no rank ever holds the [N, V] logits or the full weight."""

    group: Group

    def loss(self, h: torch.Tensor, targets: torch.Tensor, step: Step) -> torch.Tensor:
        from glm5.parallel.vocab import vocab_parallel_linear_cross_entropy

        start = self.group.rank * self.weight.shape[0]
        return vocab_parallel_linear_cross_entropy(
            enter(h, self.group), self.weight, targets, self.group, start, step.backend
        )
