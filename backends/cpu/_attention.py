"""What the cpu backend's sparse attention on float rows and on FlashMLA's FP8 rows share: the blocks of
queries with the cache rows their indices name, and the in-place softmax times values."""

from __future__ import annotations

import torch

from backends.cpu._cache import rows_of
from backends.layout import SeqLayout


def query_blocks(layout: SeqLayout, indices: torch.Tensor, cache: torch.Tensor, step: int):
    """(a, z, rows, valid) for every block of at most `step` queries [a, z) of a request with keys:
    the physical cache rows its indices name [z - a, topk] (int64, clamped into range) and which of them
    are valid (not -1, inside the request)."""
    if indices.shape[1] == 0:
        return
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            idx = indices[a:z].to(torch.int64)
            yield a, z, rows_of(layout, b, idx.clamp(0, s - 1), cache), (idx >= 0) & (idx < s)


def softmax_values(p: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, d_v: int):
    """Scores p [tq, H, n] (overwritten) and the gathered keys [tq, n, d_qk] (invalid rows zero) ->
    (out [tq, H, d_v] fp32, lse [tq, H]): softmax in place, then probabilities x values."""
    full = bool(valid.all())
    if not full:
        p.masked_fill_(~valid[:, None, :], float("-inf"))
    m = p.amax(dim=-1, keepdim=True)
    m.masked_fill_(torch.isneginf(m), 0)
    p.sub_(m).exp_()
    total = p.sum(dim=-1)  # >= 1 (the maximum contributes exp(0)) unless the row is empty: 0
    lse = total.log().add_(m[..., 0])
    out = torch.bmm(p, keys[..., :d_v])
    return out.div_(total.clamp_min_(1)[..., None]), lse
