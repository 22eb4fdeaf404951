"""cpu backend: indexer_topk (SPEC 2.2): the reference's logits, bit for bit by construction (its own
`score_block` on the same 128-query blocks and 2048-key chunks: a BLAS's summation order differs between
CPUs and call shapes, so nothing but the same call gives the same bits on every x86 CPU), selected by
`torch.topk` with exactness checks instead of two stable sorts per chunk.

Per query block, each chunk's scores are first filtered against the running k-th value (exact: a key
equal to it loses to the k lower-index keys already held), and the survivors are merged with the best
k by `torch.topk(k + 1)` once a chunk's worth has gathered; rows where the k-th and (k+1)-th candidates
tie, or NaN appears, are merged by the rule's full order. The rule's top-k set does not depend on the
merge order, so the final order (one composite-key sort per block) is the reference's. Small blocks
(decode) score all their keys into one buffer and take one exact selection. Peak extra memory per
query block: O(tq * (topk + chunk) + tq * H_I * chunk), independent of S.
"""

from __future__ import annotations

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.ops import FLOATS
from backends.cpu._cache import causal_counts, keys_of_request
from backends.cpu._parallel import run_blocks
from backends.cpu._select import order_key, rule_order
from backends.cpu._workspace import buffer
from backends.cpu.fp8_indexer_topk import IMPL as FP8_TOPK
from backends.cpu.topk import topk as select_topk
from backends.layout import SeqLayout
from backends.reference.fp8_indexer_logits import on_fp8_index_cache
from backends.reference.indexer_logits import score_block

# The reference's blocking: scores are computed on exactly these shapes, so they are its bits.
QUERY_BLOCK = 128
KEY_CHUNK = 2048
#: blocks with at most this many (query, key) logits take one exact selection over all of them
DIRECT_ELEMS = 1 << 20


class _Scorer:
    """The reference's logits for one query block: its own `score_block` on its shapes (the same call is
    the only way to the same sums on every CPU), into buffers reused across key chunks (fresh multi-MiB
    tensors cost more in page faults than the arithmetic on them)."""

    def __init__(self, q: torch.Tensor, weights: torch.Tensor) -> None:
        tq, h, _ = q.shape
        self.q, self.w = q, weights
        self.dots = buffer("indexer.dots", tq * h * KEY_CHUNK)
        self.out = buffer("indexer.out", tq * KEY_CHUNK)
        self.tq, self.h = tq, h

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [s <= KEY_CHUNK, D_I] -> [tq, s] fp32: relu(q . k) summed over heads with the weights."""
        s = keys.shape[0]
        dots = self.dots[: self.tq * self.h * s].view(self.tq * self.h, s)
        out = self.out[: self.tq * s].view(self.tq, 1, s)
        return score_block(self.q, keys, self.w, dots=dots, out=out)


def _direct_topk(q, keys, weights, visible, topk) -> torch.Tensor:
    """Small blocks (decode, short requests): every chunk's scores side by side in one [tq, S] buffer,
    then one exact selection (the cpu `topk`): bounded by DIRECT_ELEMS, so still O(chunk) memory."""
    tq, s = q.shape[0], keys.shape[0]  # chunk bounds as the reference's: the bits depend on the shapes
    score = _Scorer(q, weights)
    logits = buffer("indexer.logits", tq * s).view(tq, s)
    for c0 in range(0, s, KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, s)
        logits[:, c0:c1] = score(keys[c0:c1])
    return select_topk(logits, topk, visible)[1]


def _merge(val, idx, ok, k):
    """Rule top-k (as an unordered set) of each row of the candidates (val, idx, ok) [tq, n], n > k.
    torch.topk(k + 1) over the values with non-candidates at -inf decides every row that holds no NaN
    and whose k-th and (k+1)-th values differ; and also a row tied at -inf if no candidate is -inf
    (then it has at most k candidates, all above -inf, so all kept). Other rows take the rule."""
    vm = val.masked_fill(~ok, float("-inf"))
    v, col = torch.topk(vm, k + 1, dim=1, sorted=False)
    bad = torch.isnan(v).any(dim=1)
    v = v.masked_fill(bad[:, None], 0)
    low = v.amin(dim=1)
    tie = (v == low[:, None]).sum(dim=1) > 1
    if bool(tie.any()):
        few = tie & torch.isneginf(low)
        if bool(few.any()):
            few &= ~(ok & torch.isneginf(val)).any(dim=1)
        bad |= tie & ~few
    drop = v.argmin(dim=1, keepdim=True)
    col = col.scatter(1, drop, col[:, k:])[:, :k]
    if bool(bad.any()):
        rows = torch.nonzero(bad)[:, 0]
        by_index = torch.sort(idx[rows], dim=1).indices  # rule_order needs index-ordered columns
        order = rule_order(val[rows].gather(1, by_index), ok[rows].gather(1, by_index))
        col[rows] = by_index.gather(1, order)[:, :k]
    return val.gather(1, col), idx.gather(1, col), ok.gather(1, col)


def _survivors(sc, c0, ok, thr):
    """The chunk's candidates strictly above the block's running k-th value thr [tq], compacted to
    [tq, m] (value, index, ok) with ok False in the padding; None if there are none. A candidate equal
    to thr is never needed: k earlier keys (lower indices) already rank above it."""
    keep = ok & (sc > thr[:, None])
    r, c = torch.nonzero(keep, as_tuple=True)
    if r.numel() == 0:
        return None
    tq = sc.shape[0]
    counts = torch.bincount(r, minlength=tq)
    start = torch.zeros(tq, dtype=torch.int64)
    start[1:] = torch.cumsum(counts, 0)[:-1]
    slot = torch.arange(r.numel()) - start[r]
    m = int(counts.max())
    val = torch.full((tq, m), float("-inf"))
    idx = torch.zeros(tq, m, dtype=torch.int64)
    okm = torch.zeros(tq, m, dtype=torch.bool)
    val[r, slot], idx[r, slot], okm[r, slot] = sc[r, c], c + c0, True
    return val, idx, okm


def _block_topk(q, keys, weights, visible, topk) -> torch.Tensor:
    """Running top-k over key chunks for one query block. Chunks are first filtered against the running
    k-th value (exact: see `_survivors`); the survivors wait in `pending` and are merged with the best k
    only once there are a chunk's worth of them, so long rows merge a few times, not once per chunk."""
    tq = q.shape[0]
    score = _Scorer(q, weights)
    best = (torch.empty(tq, 0), torch.empty(tq, 0, dtype=torch.int64), torch.empty(tq, 0, dtype=torch.bool))
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    thr = None  # the best set's k-th value, once it holds k candidate numbers in every row

    def merge(best, pending):
        val, idx, ok = (torch.cat([best[i]] + [p[i] for p in pending], dim=1) for i in range(3))
        return (val, idx, ok) if val.shape[1] <= topk else _merge(val, idx, ok, topk)

    for c0 in range(0, int(visible.max()), KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, keys.shape[0])
        sc = score(keys[c0:c1])
        ar = torch.arange(c0, c1)
        ok = ar[None, :] < visible[:, None]
        if thr is None:
            pending.append((sc.clone(), ar.expand(tq, -1), ok))
        else:
            surv = _survivors(sc, c0, ok, thr)
            if surv is not None:
                pending.append(surv)
        width = sum(p[0].shape[1] for p in pending)
        if width >= KEY_CHUNK and best[0].shape[1] + width > topk:
            best, pending = merge(best, pending), []
            full = best[0].shape[1] == topk and bool(best[2].all()) and not bool(torch.isnan(best[0]).any())
            thr = best[0].amin(dim=1) if full else None
    if pending:
        best = merge(best, pending)
    best_val, best_idx, best_ok = best
    if best_val.shape[1] == 0:
        return torch.full((tq, topk), -1, dtype=torch.int32)
    if not bool((best_ok & torch.isnan(best_val)).any()):  # numbers only: one composite-key sort
        key = order_key(best_val, best_idx).masked_fill_(~best_ok, torch.iinfo(torch.int64).min)
        key, perm = torch.sort(key, dim=1, descending=True)
        res = torch.where(best_ok.gather(1, perm), best_idx.gather(1, perm), -1)
    else:
        by_index = torch.sort(best_idx, dim=1).indices
        v, i, o = best_val.gather(1, by_index), best_idx.gather(1, by_index), best_ok.gather(1, by_index)
        order = rule_order(v, o)
        res = torch.where(o.gather(1, order), i.gather(1, order), -1)
    res = res.to(torch.int32)
    return torch.nn.functional.pad(res, (0, topk - res.shape[1]), value=-1)


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout, topk: int
) -> torch.Tensor:
    """Inputs as indexer_logits. Returns int32 [T, topk] logical positions in the rule's order, -1 past
    the causal keys. Query blocks are spread over torch's thread count, each on one intra-op thread
    (backends/cpu/_parallel.py); the scores are one-thread calls either way, so the bits do not change.
    Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)

    def blocks():
        for b, (q0, q1, s) in enumerate(layout.request_bounds()):
            if q1 == q0 or s == 0:
                continue
            keys = keys_of_request(k_cache, layout, b, s)
            visible = causal_counts(q1 - q0, s)
            for a in range(q0, q1, QUERY_BLOCK):
                z = min(a + QUERY_BLOCK, q1)
                yield a, z, keys, visible[a - q0 : z - q0]

    def select(block) -> None:
        a, z, keys, vis = block
        pick = _direct_topk if (z - a) * keys.shape[0] <= DIRECT_ELEMS else _block_topk
        out[a:z] = pick(q[a:z], keys, weights[a:z], vis, topk)

    run_blocks(select, blocks())
    return out


IMPL = by_kind(
    OpImpl(
        indexer_topk,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            notes={"logits": "the reference's score_block on its blocks (the same call: bitwise on any CPU)"},
            run_to_run=True,
            batch_invariant=True,
            tie_rule="lower_index",
            layout_invariant=True,  # its logits are score_block's, exact in the mode
        ),
    ),
    dict.fromkeys(FP8_KINDS, on_fp8_index_cache(FP8_TOPK)),  # the FP8 indexer cache (SPEC 7.8)
)
