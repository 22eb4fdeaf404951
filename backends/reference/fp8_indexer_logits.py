"""FP8 lightning-indexer logits (SPEC 7.4; DeepSeek-V3.2 `kernel.py::fp8_index`, DeepGEMM
`fp8_mqa_logits` / `fp8_paged_mqa_logits`).

q e4m3 [T, H_I, D_I] (one scale per token and head, folded into `weights` by the caller);
k_cache e4m3 ragged [rows, D_I] or paged [nb, bs, D_I]; k_scale fp32 with the cache's shape minus D_I
(ragged [rows], paged [nb, bs]): one scale per key; weights fp32 [T, H_I].

    logits[t, j] = k_scale[j] * sum_h weights[t, h] * relu(dot(q[t, h], k[j]))     causal j; else -inf

The reference evaluates the real-number formula in fp64 (e4m3 products and their 128-term sums are
exact there) and rounds once to fp32. ReLU acts on the raw fp8 dot product, before the (possibly
negative) head weights. The key scale multiplies the head sum, as DeepSeek's `fp8_index` and DeepGEMM's
SM90 kernel do; since k_scale > 0 this equals the relu(q . (k * k_scale)) * w form of DeepGEMM's test.
`quantize_indexer_inputs` is how a model produces these inputs from bf16 q, k and head weights.
This module is the op's declaration too (`DECL`: the function below is the signature; validators, fake,
sized builder, sample).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.argcheck import check_heads, check_same_device, check_tensor
from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.intra_op import one_thread
from backends.layout import SeqLayout, check_cache, check_layout
from backends.reference import indexer_logits as float_op
from backends.reference._cache import causal_counts, keys_of_request
from backends.reference._common import E4M3, FLOATS, FP8, dtype_of, randn
from backends.reference.fp8_format import EPS_DEEPSEEK, cast_e4m3, group_scale, index_cache_views

_BLOCK_ELEMS = 1 << 24


def fp8_score_block(q: torch.Tensor, keys: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor):
    """q e4m3 [tq, H_I, D_I], keys e4m3 [s, D_I], k_scale [s], weights [tq, H_I] -> fp32 [tq, s], no mask.
    On one intra-op thread: the fp64 head sum is not exact, so its bits must not follow the thread count."""
    with one_thread():
        dots = torch.einsum("thd,sd->ths", q.double(), keys.double())  # exact
        return (torch.einsum("ths,th->ts", torch.relu(dots), weights.double()) * k_scale.double()).float()


@reference_op("fp8_indexer_logits")
def fp8_indexer_logits(
    q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    """q e4m3 [T, H_I, D_I], k_cache e4m3 ragged [rows, D_I] / paged [nb, bs, D_I], k_scale fp32 [rows] /
    [nb, bs], weights fp32 [T, H_I] (q scale folded in) -> fp32 [T, max(seqlens_k)]."""
    t, h_i, _ = q.shape
    out = torch.full((t, layout.seqlen_k_max()), float("-inf"), dtype=torch.float32)
    scales = k_scale.unsqueeze(-1)  # read through the same layout as the keys
    for b, (q0, q1, s) in enumerate(layout.request_bounds()):
        if q1 == q0 or s == 0:
            continue
        keys = keys_of_request(k_cache, layout, b, s)
        ks = keys_of_request(scales, layout, b, s)[:, 0]
        visible = causal_counts(q1 - q0, s)
        step = max(1, _BLOCK_ELEMS // (h_i * s))
        for a in range(q0, q1, step):
            z = min(a + step, q1)
            sc = fp8_score_block(q[a:z], keys, ks, weights[a:z])
            causal = torch.arange(s)[None, :] < visible[a - q0 : z - q0, None]
            out[a:z, :s] = sc.masked_fill(~causal, float("-inf"))
    return out


def quantize_indexer_inputs(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, eps: float = EPS_DEEPSEEK, ue8m0: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16/fp32 q [T, H_I, D_I], k [S, D_I], head weights [T, H_I] (H_I^-0.5 * D_I^-0.5 already folded in)
    -> (q e4m3, k e4m3, k_scale fp32 [S], weights * q_scale fp32): one e4m3 group per head vector and per
    key (D_I = 128), UE8M0 scales as DeepSeek-V3.2 and vLLM use."""
    qs = group_scale(q.float().abs().amax(dim=-1), eps, ue8m0)  # [T, H_I]
    ks = group_scale(k.float().abs().amax(dim=-1), eps, ue8m0)  # [S]
    q8 = cast_e4m3(q.float() / qs[..., None])
    k8 = cast_e4m3(k.float() / ks[..., None])
    return q8, k8, ks, weights.float() * qs


def quantize_index_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H_I, D_I] float and head weights [T, H_I] -> (q e4m3, weights * q scale fp32): the query half
    of `quantize_indexer_inputs`."""
    q8, _, _, w8 = quantize_indexer_inputs(q, q.new_empty(0, q.shape[2]), weights)
    return q8, w8


def on_fp8_index_cache(fp8: OpImpl) -> OpImpl:
    """A backend's fp8_indexer_logits / fp8_indexer_topk as the entry of indexer_logits / indexer_topk for
    the FP8 indexer cache (SPEC 7.8): q quantized here (per head vector, UE8M0, its scale folded into the
    head weights), keys and scales read in place through views of the uint8 cache. Its caps are the FP8
    op's, on the float op's dtype axis (the dtype of q)."""

    def fn(q, k_cache, weights, layout, **rest):
        keys, scales = index_cache_views(k_cache)
        q8, w8 = quantize_index_queries(q, weights)
        return fp8.fn(q=q8, k_cache=keys, k_scale=scales, weights=w8, layout=layout, **rest)

    return OpImpl(fn, replace(fp8.caps, dtypes=FLOATS, layouts=FP8_KINDS))


def check(q, k_cache, k_scale, weights, layout) -> None:
    check_tensor("q", q, dtype=E4M3, ndim=3)
    t, h_i, d_i = q.shape
    check_heads(q)
    check_tensor("k_cache", k_cache, dtype=E4M3, ndim=(2, 3))
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, h_i))
    check_same_device(q=q, k_cache=k_cache, k_scale=k_scale, weights=weights)
    check_layout(layout, t, k_cache, "k_cache")
    check_cache("k_cache", k_cache, layout, d_i, E4M3)
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=tuple(k_cache.shape[:-1]))


def values(q, k_cache, k_scale, weights, layout) -> None:
    layout.check(q.shape[0], k_cache, "k_cache")


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    q8, k8, ks, w8 = quantize_indexer_inputs(randn(g, 2, 2, 32), randn(g, 5, 32), randn(g, 2, 2))
    return dict(q=q8, k_cache=k8, k_scale=ks, weights=w8, layout=SeqLayout.from_lengths([2], [5]))


def sized(g: torch.Generator, dt: str, quantity: str, v: int, topk: int = 64) -> dict:
    """The float indexer's case (indexer_logits.sized), quantized as DeepSeek-V3.2 does (e4m3 q and keys,
    one scale per key)."""
    a = float_op.sized(g, "float32", quantity, v, topk)
    nb, bs, d = a["k_cache"].shape
    q8, k8, ks, w8 = quantize_indexer_inputs(a["q"], a["k_cache"].reshape(-1, d), a["weights"])
    return a | dict(q=q8, k_cache=k8.reshape(nb, bs, d), k_scale=ks.reshape(nb, bs), weights=w8)


QUANTITIES = float_op.QUANTITIES

DECL = OpDecl(
    name="fp8_indexer_logits",
    spec_section="7.4",
    signature=fp8_indexer_logits,
    dtype_axis=FP8,
    dtype_of=dtype_of("q"),
    validate=check,
    values=values,
    fake=float_op.fake,
    sample=sample,
    sized=sized,
    sharding="replicated",
    cache_arg="k_cache",
    quantities=QUANTITIES,
)
IMPL = OpImpl(fp8_indexer_logits, OpCaps(FP8, ("ragged", "paged")))
