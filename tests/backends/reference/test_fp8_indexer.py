"""fp8_indexer_logits / fp8_indexer_topk (SPEC 7.4, 7.5) restated from DeepGEMM's `ref_fp8_mqa_logits`
(ragged: per-query key windows [ks, ke)) and `ref_fp8_paged_mqa_logits`, and against the fp32 indexer."""

from __future__ import annotations

import torch

from backends.layout import SeqLayout
from backends.reference.fp8_indexer_logits import fp8_indexer_logits, quantize_indexer_inputs
from backends.reference.fp8_indexer_topk import fp8_indexer_topk
from backends.reference.indexer_logits import indexer_logits
from backends.reference.topk import topk as rule_topk


def deepgemm_mqa_logits(q, kv, kv_scale, weights, ks, ke):
    """tests/test_attention.py: score = einsum('mhd,nd->hmn', q, kv * scale); logits = sum_h relu(score)
    * weights; columns outside [ks, ke) are -inf (clean_logits)."""
    score = torch.einsum("mhd,nd->hmn", q.double(), kv.double() * kv_scale.double()[:, None])
    logits = (score.relu() * weights.double().T[..., None]).sum(0)
    col = torch.arange(kv.shape[0])[None, :]
    return logits.masked_fill((col < ks[:, None]) | (col >= ke[:, None]), float("-inf"))


def _inputs(g, q_lens, k_lens, h=8, d=128):
    t, s = sum(q_lens), sum(k_lens)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    k = torch.randn(s, d, generator=g).bfloat16()
    w = torch.randn(t, h, generator=g) * (h**-0.5 * d**-0.5)
    return q, k, w, SeqLayout.from_lengths(q_lens, k_lens)


def _windows(q_lens, k_lens):
    ks, ke, c = [], [], 0
    for tb, sb in zip(q_lens, k_lens):
        for i in range(tb):
            ks.append(c)
            ke.append(c + max(0, min(sb, sb - tb + i + 1)))
        c += sb
    return torch.tensor(ks), torch.tensor(ke)


def test_ragged_matches_deepgemm_reference():
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = [1, 3, 4], [300, 150, 4]
    q, k, w, layout = _inputs(g, q_lens, k_lens)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, w)
    ours = fp8_indexer_logits(q8, k8, ks, w8, layout)
    ref = deepgemm_mqa_logits(q8, k8, ks, w8, *_windows(q_lens, k_lens))
    # DeepGEMM's logits are over the concatenated keys; ours are per request (column = logical position)
    c = 0
    for q0, q1, s in layout.request_bounds():
        mine, theirs = ours[q0:q1, :s].double(), ref[q0:q1, c : c + s]
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
        fin = torch.isfinite(theirs)
        assert ((mine - theirs).abs()[fin] <= 2.0**-23 * theirs.abs()[fin] + 1e-30).all()
        assert torch.isinf(ours[q0:q1, s:]).all()
        c += s


def test_paged_equals_ragged_and_fp8_error_against_fp32_is_small():
    g = torch.Generator().manual_seed(1)
    q_lens, k_lens = [2, 1], [2100, 700]
    q, k, w, ragged = _inputs(g, q_lens, k_lens, h=32)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, w)
    bs = 64
    paged = SeqLayout.from_lengths(
        q_lens, k_lens, block_size=bs, block_order=[5, 0, 3, 1, 4, 2][::-1] + list(range(6, 50))
    )
    nb = 50
    cache = torch.zeros(nb, bs, 128).to(torch.float8_e4m3fn)
    scale = torch.full((nb, bs), float("nan"))
    for b, (_, _, s) in enumerate(ragged.request_bounds()):
        start = ragged.host()["cu_k"][b]
        rows = paged.physical_rows(b, torch.arange(s), cache)
        cache.view(-1, 128)[rows] = k8[start : start + s]
        scale.view(-1)[rows] = ks[start : start + s]
    a = fp8_indexer_logits(q8, k8, ks, w8, ragged)
    b = fp8_indexer_logits(q8, cache, scale, w8, paged)
    assert torch.equal(a, b)
    # SPEC 4's global metric against the unquantized fp32 indexer
    full = indexer_logits(q.float(), k.float(), w, ragged)
    fin = torch.isfinite(full)
    x, y = a[fin].double(), full[fin].double()
    assert 1 - 2 * (x * y).sum() / (x * x + y * y).sum() < 1e-3


def test_topk_is_the_rule_on_the_logits():
    g = torch.Generator().manual_seed(2)
    q_lens, k_lens = [3, 1], [2500, 40]
    q, k, w, layout = _inputs(g, q_lens, k_lens, h=4)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, w)
    logits = fp8_indexer_logits(q8, k8, ks, w8, layout)
    lengths = torch.tensor([2498, 2499, 2500, 40])
    want = rule_topk(logits, 64, lengths)[1]
    assert torch.equal(fp8_indexer_topk(q8, k8, ks, w8, layout, 64), want)
