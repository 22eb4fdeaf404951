"""Linear + cross-entropy in sequence chunks (SPEC 2.9).

    loss = mean_{i : targets[i] != ignore_index} ( logsumexp_v(h[i] @ W[v]) - h[i] @ W[targets[i]] )

fp32 throughout. The forward returns (loss, lse [N]), keeping only the per-row logsumexp; the declared
backward recomputes each chunk's logits from it, so the [N, V] fp32 logits never exist at once (the
chunking is backends/linear_ce.py, shared by every backend; this file gives the per-chunk math). With no
counted target the loss is NaN (as torch.nn.functional.cross_entropy) and the gradients are zero.
`linear_cross_entropy_naive` is the plain definition; tests check the two agree.
"""

from __future__ import annotations

import functools

import torch

from backends import linear_ce
from backends.caps import OpCaps, OpImpl
from backends.counters import reference_op
from backends.linear_ce import LinearCEKernels, row_chunks
from backends.ops import FLOATS

# Rows per chunk are chosen so one chunk's fp32 logits stay under this many elements.
_CHUNK_ELEMS = 1 << 24


def linear_cross_entropy_naive(h, weight, targets, ignore_index=-100):
    logits = h.float() @ weight.float().T  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=ignore_index)


def _forward(h, wf, targets, ignore_index):
    counted = targets != ignore_index  # [n]
    tgt = torch.where(counted, targets, 0).long()
    logits = h.float() @ wf.T  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, tgt[:, None])[:, 0]
    return lse, nll[counted].sum()


def _backward(h, wf, targets, ignore_index, lse, scale):
    counted = targets != ignore_index
    tgt = torch.where(counted, targets, 0).long()
    hf = h.float()
    p = torch.exp(hf @ wf.T - lse[:, None])  # softmax [n, V]
    p[torch.arange(p.shape[0]), tgt] -= 1.0
    p = p * (counted[:, None] * scale)
    return p @ wf, p.T @ hf


def _chunks(n: int, v: int):
    return row_chunks(_CHUNK_ELEMS)(n, v)  # read at call time: tests shrink _CHUNK_ELEMS to force chunking


_KERNELS = LinearCEKernels(_chunks, _forward, _backward, cast=lambda h, w: (h, w.float()))


@reference_op("linear_cross_entropy")
def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss fp32 scalar, lse fp32 [N]); the front door returns the loss alone."""
    return linear_ce.forward(_KERNELS, h, weight, targets, ignore_index)


IMPL = OpImpl(
    linear_cross_entropy,
    OpCaps(FLOATS, differentiable=True),
    backward=functools.partial(linear_ce.backward, _KERNELS),
)
