"""cpu backend: linear_cross_entropy (SPEC 2.9): chunked forward keeping only the per-row logsumexp, and a
backward that recomputes each chunk's logits and turns them into the softmax gradient in place, so the
[N, V] logits never exist at once. fp32 throughout (weight cast once per call). The chunking and the
declared backward are backends/linear_ce.py's.
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


def _forward(h, wf, targets, ignore_index):
    counted = targets != ignore_index
    tgt = torch.where(counted, targets, 0).long()
    logits = h.float() @ wf.T
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, tgt[:, None])[:, 0]
    return lse, nll.masked_fill_(~counted, 0).sum()


def _backward(h, wf, targets, ignore_index, lse, scale):
    counted = targets != ignore_index
    tgt = torch.where(counted, targets, 0).long()
    hf = h.float()
    p = torch.mm(hf, wf.T).sub_(lse[:, None]).exp_()
    p[torch.arange(p.shape[0]), tgt] -= 1.0
    p.mul_(counted[:, None] * scale)
    return p @ wf, p.T @ hf


_KERNELS = LinearCEKernels(row_chunks(CHUNK_ELEMS), _forward, _backward, cast=lambda h, w: (h, w.float()))


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [N, D] float; weight: [V, D] float; targets: int [N]. Returns (float32 scalar loss, NaN with no
    counted target; lse float32 [N]). Semantics: backends/reference/linear_cross_entropy.py
    """
    return linear_ce.forward(_KERNELS, h, weight, targets, ignore_index)


IMPL = OpImpl(
    linear_cross_entropy,
    OpCaps(FLOATS, run_to_run=True, batch_invariant=True, differentiable=True),
    backward=functools.partial(linear_ce.backward, _KERNELS),
)
