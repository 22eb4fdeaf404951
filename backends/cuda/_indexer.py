"""What the two indexer ops of the cuda backend share: limits, the layout arguments of their kernels, and
their logits in the layout-invariant mode (`exact_logits`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from backends.contract.limits import Limit
from backends.cuda import _invariant
from backends.invariant import engine as invariant
from backends.layout import SeqLayout

MAX_HEADS = 128
MAX_HEAD_DIM = 256
LIMITS = (
    Limit("index_heads", max=MAX_HEADS, reason="(query, head) rows of a tile are one register tile"),
    Limit("index_head_dim", max=MAX_HEAD_DIM, reason="a head row is one register tile"),
)


def check(args: dict[str, Any], *, differentiable_output: bool = True) -> list[str]:
    """For an op with a differentiable output (logits): inputs requiring grad (the kernels have no
    backward)."""
    out = []
    grads = [n for n in ("q", "k_cache", "weights") if args[n].requires_grad]
    if differentiable_output and grads and torch.is_grad_enabled():
        out.append(f"{', '.join(grads)} require grad: the cuda indexer kernels have no backward")
    return out


def layout_args(layout: SeqLayout) -> dict[str, Any]:
    return dict(
        cu_seqlens_q=layout.cu_seqlens_q,
        seqlens_k=layout.seqlens_k,
        cu_seqlens_k=layout.cu_seqlens_k,
        block_table=layout.block_table,
    )


#: the layout-invariant mode's key chunk, and its bound on one query block's logits, gathered keys and
#: head dots (elements)
KEY_CHUNK = 2048
BLOCK_ELEMS = 1 << 24


def exact_logits(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """SPEC 12: (a, z, logits fp32 [z - a, max(seqlens_k)] -inf where not causal, causal key counts [z - a])
    per block of queries [a, z): relu(exact(q, K^T)) on the Triton engine, weighted over the heads by the
    fixed tree (`weighted_sum`; H is never split), keys gathered on the device in chunks."""
    t, h, d = q.shape
    s_max = layout.seqlen_k_max()
    if t == 0 or s_max == 0:
        return
    req = _invariant.requests(layout, t)
    visible = _invariant.causal_counts(layout, req)
    chunk = min(KEY_CHUNK, s_max)
    step = max(1, BLOCK_ELEMS // max(s_max, chunk * max(h, d)))
    for a in range(0, t, step):
        z = min(a + step, t)
        logits = torch.empty((z - a, s_max), device=q.device)
        for c0 in range(0, s_max, chunk):
            c1 = min(c0 + chunk, s_max)
            pos = torch.arange(c0, c1, device=q.device).expand(z - a, -1)
            causal = pos < visible[a:z, None]
            keys = _invariant.gather(k_cache, layout, req[a:z], pos, causal)  # [tq, c, D_I]
            dots = invariant.exact_matmul(q[a:z].float(), keys.transpose(1, 2), engine=_invariant.ENGINE)
            scores = invariant.weighted_sum(weights[a:z], dots.relu_())  # [tq, c]
            logits[:, c0:c1] = scores.masked_fill(~causal, float("-inf"))
        yield a, z, logits, visible[a:z]
