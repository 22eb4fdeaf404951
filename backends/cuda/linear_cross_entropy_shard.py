"""cuda backend: linear_cross_entropy_shard (SPEC 2.9.1): each row chunk's logits from
kernels_cuda.linear_cross_entropy.chunk_logits (the Triton GEMM of linear_cross_entropy, fp32 out), the
shard's per-row max, sum of exponentials and target logit from them with torch reductions; the backward
recomputes the chunk's logits with the same kernel and turns them into d logits in place. Peak extra
memory is one [rows, V] fp32 chunk. The chunking and the declared backward are backends/linear_ce.py's.
"""

from __future__ import annotations

import functools

import torch

from backends import linear_ce
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cuda.linear_cross_entropy import CHUNK_ELEMS, _cast
from backends.linear_ce import LinearCEKernels, row_chunks


def _forward(h, w, targets, vocab_start, ignore_index):
    from kernels_cuda.linear_cross_entropy import chunk_logits

    logits = chunk_logits(h, w)
    m = logits.amax(dim=-1)
    mine, idx = linear_ce.owned_rows(targets, w.shape[0], vocab_start, ignore_index)
    t = logits.gather(1, idx[:, None])[:, 0].masked_fill_(~mine, 0.0)
    return m, logits.sub_(m[:, None]).exp_().sum(dim=-1), t


def _backward(h, w, targets, vocab_start, ignore_index, m, gs, gt):
    from kernels_cuda.linear_cross_entropy import chunk_logits

    p = chunk_logits(h, w).sub_(m[:, None]).exp_().mul_(gs[:, None])
    mine, idx = linear_ce.owned_rows(targets, w.shape[0], vocab_start, ignore_index)
    p[torch.arange(p.shape[0], device=p.device), idx] += gt.masked_fill(~mine, 0.0)
    return p @ w.float(), p.T @ h.float()


_KERNELS = LinearCEKernels(row_chunks(CHUNK_ELEMS, 128), _forward, _backward, cast=_cast)


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
    OpCaps(FLOATS, differentiable=True, notes={"peak logits": f"{CHUNK_ELEMS} fp32 elements per chunk"}),
    backward=functools.partial(linear_ce.shard_backward, _KERNELS),
)
