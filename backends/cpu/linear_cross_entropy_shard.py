"""cpu backend: linear_cross_entropy_shard (SPEC 2.9.1): one vocabulary shard's per-row max, sum of
exponentials and target logit in row chunks, and a backward that recomputes each chunk's logits from the
saved max and turns them into the gradient in place. fp32 throughout (weight cast once per call). The
chunking and the declared backward are backends/linear_ce.py's.
"""

from __future__ import annotations

import functools

import torch

from backends import linear_ce
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.linear_ce import LinearCEKernels, row_chunks

# Rows per chunk: one chunk's fp32 logits stay under this many elements (16 MiB).
CHUNK_ELEMS = 1 << 22


def _forward(h, wf, targets, vocab_start, ignore_index):
    logits = torch.mm(h.float(), wf.T)
    m = logits.amax(dim=-1)
    mine, idx = linear_ce.owned_rows(targets, wf.shape[0], vocab_start, ignore_index)
    t = logits.gather(1, idx[:, None])[:, 0].masked_fill_(~mine, 0.0)
    s = logits.sub_(m[:, None]).exp_().sum(dim=-1)  # in place: the chunk's logits are spent
    return m, s, t


def _backward(h, wf, targets, vocab_start, ignore_index, m, gs, gt):
    hf = h.float()
    p = torch.mm(hf, wf.T).sub_(m[:, None]).exp_().mul_(gs[:, None])
    mine, idx = linear_ce.owned_rows(targets, wf.shape[0], vocab_start, ignore_index)
    p[torch.arange(p.shape[0]), idx] += gt.masked_fill(~mine, 0.0)
    return p @ wf, p.T @ hf


_KERNELS = LinearCEKernels(row_chunks(CHUNK_ELEMS), _forward, _backward, cast=lambda h, w: (h, w.float()))


def linear_cross_entropy_shard(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h: [N, D] float; weight: [V, D] float (vocabulary rows from vocab_start); targets: int [N] global ids.
    Returns (max, sumexp, target logit), float32 [N] each.
    Semantics: backends/reference/linear_cross_entropy_shard.py (SPEC 2.9.1)
    """
    return linear_ce.shard_forward(_KERNELS, h, weight, targets, vocab_start, ignore_index)


IMPL = OpImpl(
    linear_cross_entropy_shard,
    OpCaps(FLOATS, run_to_run=True, batch_invariant=True, differentiable=True),
    backward=functools.partial(linear_ce.shard_backward, _KERNELS),
)
