"""cpu backend: sparse_mla_attention (SPEC 2.4): per query block, one gather of the named latent rows
(in the cache's dtype, cast once to fp32) and two batched GEMMs (scores, then probabilities x values),
softmax in place between them. The query blocks are spread over torch's intra-op thread
count of Python threads, each block on one intra-op thread (`_parallel.py`: a loaded machine no longer
makes it 3-6x slower than one thread, and the bits are the one-thread run's at any thread count).

Backward (`backward`, what training runs through the custom op): from the forward's saved out and lse,
per query block, the probabilities are recomputed from one more gather and GEMM with the saved lse,
dS = P * (dP - sum_j P dP) + P * dlse, then dq and the gathered rows' dK / dV, summed into dkv with
index_add_ (sequential on the CPU: deterministic). The forward itself never records autograd.

In the layout-invariant mode (SPEC 12) the same blocks, gathers and threads run `exact_attention`
(backends/invariant/attention.py): exact scores, the fixed-tree log-sum-exp and the formula exp, exact
probabilities x values (the bits the SPEC writes down, so the reference's too).
"""

from __future__ import annotations

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl, by_kind
from backends.contract.ops import FLOATS
from backends.cpu._attention import query_blocks, softmax_values
from backends.cpu._cache import flat
from backends.cpu._parallel import run_blocks
from backends.cpu._workspace import buffer
from backends.cpu.fp8_sparse_mla_attention import IMPL as FP8_ATTENTION
from backends.invariant import engine as invariant
from backends.invariant.attention import exact_attention
from backends.layout import SeqLayout

# Bound the gathered [tq, topk, d_qk] keys (elements): 4M fp32 = 16 MiB, a few queries at topk 2048.
GATHER_ELEMS = 1 << 22


def _gathered(cache: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The named rows as fp32 [tq, n, d_qk], invalid ones zero (never read as values: may be NaN)."""
    tq, n = rows.shape
    keys = flat(cache).index_select(0, rows.reshape(-1)).view(tq, n, -1).float()
    return keys.masked_fill(~valid[..., None], 0)


class _Workspace:
    """Buffers reused across query blocks: a fresh multi-MiB gather or score tensor per block costs
    more in page faults than the copy or GEMM that fills it."""

    def __init__(self, step: int, n: int, h: int, d_qk: int, dtype: torch.dtype) -> None:
        self.raw = buffer("mla.raw", step * n * d_qk, dtype).view(step * n, d_qk)
        self.keys = self.raw if dtype == torch.float32 else buffer("mla.keys", step * n * d_qk).view(-1, d_qk)
        self.p = buffer("mla.p", step * h * n).view(step, h, n)
        self.n = n

    def block(self, q, cache, rows, valid, d_v, exact_scale: float | None = None):
        """q [tq, H, d_qk] fp32 already scaled by sm_scale -> (out [tq, H, d_v] fp32, lse [tq, H]);
        with exact_scale (the mode), q unscaled and `exact_attention`."""
        tq, n = rows.shape
        raw = self.raw[: tq * n]
        torch.index_select(flat(cache), 0, rows.reshape(-1), out=raw)
        keys = self.keys[: tq * n]
        if keys is not raw:
            keys.copy_(raw)
        keys = keys.view(tq, n, -1)
        if not bool(valid.all()):
            keys.masked_fill_(~valid[..., None], 0)
        if exact_scale is not None:
            return exact_attention(q, keys, valid, d_v, exact_scale)
        p = self.p[:tq]
        torch.bmm(q, keys.transpose(1, 2), out=p)
        return softmax_values(p, keys, valid, d_v)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, H, d_qk]; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk]; indices: int32 [T, topk].
    Returns (out [T, H, d_v] dtype of q, lse [T, H] float32, or None if not return_lse).
    Differentiable in q and kv_cache. Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
    """
    t, h, d_qk = q.shape
    n = indices.shape[1]
    out = torch.zeros(t, h, d_v)  # rows of requests with no keys stay 0, their lse -inf
    lse = torch.full((t, h), float("-inf"))
    step = max(1, GATHER_ELEMS // max(1, n * d_qk))
    exact_scale = sm_scale if invariant.active() else None  # SPEC 12: scaled after the exact product
    qf = q.float() if exact_scale is not None else q.float() * sm_scale

    def block(args) -> None:  # per thread workspace (its buffers are thread-local)
        a, z, rows, valid = args
        ws = _Workspace(min(step, t), n, h, d_qk, kv_cache.dtype)
        out[a:z], lse[a:z] = ws.block(qf[a:z], kv_cache, rows, valid, d_v, exact_scale)

    run_blocks(block, query_blocks(layout, indices, kv_cache, step))
    return out.to(q.dtype), (lse if return_lse else None)


def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq like q, dkv like kv_cache) from the forward's (out, lse) and (d_out, d_lse or None)."""
    q, kv_cache, indices, layout = args["q"], args["kv_cache"], args["indices"], args["layout"]
    sm_scale, d_v = args["sm_scale"], args["d_v"]
    (_, lse), (d_out, d_lse) = outputs, grad_outputs  # lse is what the probabilities need
    t, h, d_qk = q.shape
    n = indices.shape[1]
    dq = torch.zeros(t, h, d_qk)
    dkv = torch.zeros(flat(kv_cache).shape)
    if d_out is None:
        d_out = torch.zeros(t, h, d_v)
    qf, dof = q.float(), d_out.float()
    step = max(1, GATHER_ELEMS // max(1, n * d_qk))
    for a, z, rows, valid in query_blocks(layout, indices, kv_cache, step):
        keys = _gathered(kv_cache, rows, valid)
        scores = torch.bmm(qf[a:z] * sm_scale, keys.transpose(1, 2))
        shift = torch.where(torch.isneginf(lse[a:z]), float("inf"), lse[a:z])[..., None]
        p = torch.exp(scores - shift).masked_fill_(~valid[:, None, :], 0)  # [tq, H, n]
        dp = torch.bmm(dof[a:z], keys[..., :d_v].transpose(1, 2))
        # softmax's backward as autograd forms it (delta = sum_j p dP, not rowsum(dO * O)): the same
        # rounding as the reference where p is near one-hot and dP - delta cancels
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if d_lse is not None:
            ds += p * d_lse[a:z].float()[..., None]
        dq[a:z] = torch.bmm(ds, keys).mul_(sm_scale)
        dk = torch.bmm(ds.transpose(1, 2), qf[a:z]).mul_(sm_scale)  # [tq, n, d_qk]
        dk[..., :d_v] += torch.bmm(p.transpose(1, 2), dof[a:z])
        dk.masked_fill_(~valid[..., None], 0)
        dkv.index_add_(0, rows.reshape(-1), dk.reshape(-1, d_qk))
    return dq.to(q.dtype), dkv.view(kv_cache.shape).to(kv_cache.dtype)


IMPL = by_kind(
    OpImpl(
        sparse_mla_attention,
        OpCaps(
            FLOATS,
            ("ragged", "paged"),
            run_to_run=True,
            batch_invariant=True,
            differentiable=True,
            layout_invariant=True,
        ),
        backward=backward,
        backward_forces={"return_lse": True},
    ),
    dict.fromkeys(FP8_KINDS, FP8_ATTENTION),  # FlashMLA's 656-byte rows (SPEC 7.8)
)
