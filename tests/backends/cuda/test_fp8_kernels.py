"""cuda FP8 ops (SPEC 7) against the reference, through the backend front door. Under Triton 3.5.1's
interpreter every FP8 path runs, bf16 included: the kernels round to e4m3 and bf16 in fp32 arithmetic
(`snap_e4m3`, `rne_bf16`) before every cast, so the interpreter's truncating fp32 -> fp8 / bf16 casts
only ever see representable values, and the attention kernel does its bf16 dots on fp32 copies there.

Semantics: backends/reference/fp8_*.py (SPEC 7)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from backends.layout import SeqLayout
from backends.reference.fp8_block_matmul import fp8_block_matmul as ref_gemm
from backends.reference.fp8_format import quantize_weight_blocks
from backends.reference.fp8_grouped_matmul import fp8_grouped_matmul as ref_grouped
from backends.reference.fp8_indexer_logits import fp8_indexer_logits as ref_logits
from backends.reference.fp8_indexer_logits import quantize_indexer_inputs
from backends.reference.fp8_indexer_topk import fp8_indexer_topk as ref_topk
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant as ref_rows
from backends.reference.fp8_mla_cache_quant import write_rows
from backends.reference.fp8_quant_group import fp8_quant_group as ref_quant
from backends.reference.fp8_sparse_mla_attention import fp8_sparse_mla_attention as ref_attn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _u8(t):
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("eps,ue8m0", [(1e-4, False), (1e-10, True)])
def test_quant_group_bitwise(cuda, device, launches, dt, eps, ue8m0):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 300, generator=g) * torch.logspace(-6, 3, 9)[:, None]).to(dt)
    x[2, :128] = 0
    q, s = cuda.fp8_quant_group(x.to(device), 128, eps, ue8m0)
    rq, rs = ref_quant(x, 128, eps, ue8m0)
    assert torch.equal(_u8(q), _u8(rq)) and torch.equal(s.cpu(), rs)
    assert launches()["fp8_quant_group"] == 1


def test_quant_group_ties_subnormals_saturation(cuda, device):
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)].unique()
    mids = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mids, torch.tensor([448.0, -448.0, 1e30])]).reshape(1, -1)
    q, s = cuda.fp8_quant_group(x.to(device), x.shape[1], 1e-4, False)
    rq, rs = ref_quant(x, x.shape[1], 1e-4, False)
    assert torch.equal(_u8(q), _u8(rq)) and torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("dt", DTYPES)
def test_mla_cache_rows_bitwise(cuda, device, dt):
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(19, 576, generator=g) / 10).clamp(-1, 1).to(dt)
    kv[0, :128] = 0
    kv[1, 128] = 448.0 / 8
    assert torch.equal(cuda.fp8_mla_cache_quant(kv.to(device)).cpu(), ref_rows(kv))


def _gemm_inputs(g, m, n, k):
    x_q, x_s = ref_quant(torch.randn(m, k, generator=g), 128, 1e-4, False)
    w_q, w_s = quantize_weight_blocks(torch.randn(n, k, generator=g) * 0.05)
    return x_q, x_s, w_q, w_s


@pytest.mark.parametrize("m,n,k", [(5, 200, 300), (33, 130, 129), (1, 7, 1000)])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_block_matmul_matches_reference(cuda, device, m, n, k, out_dtype):
    g = torch.Generator().manual_seed(m + n + k)
    x_q, x_s, w_q, w_s = _gemm_inputs(g, m, n, k)
    bias = torch.randn(n, generator=g)
    out = cuda.fp8_block_matmul(*(t.to(device) for t in (x_q, x_s, w_q, w_s)), bias.to(device), out_dtype)
    ref = ref_gemm(x_q, x_s, w_q, w_s, bias, out_dtype)
    # fp32: the kernel's fp32 block sums differ from the exact ones by a few ulps; narrower outputs
    # round the same fp32 value, so they agree unless that value sits on a rounding boundary (1 ulp)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=1e-5)
    if out_dtype != torch.float32:
        assert (out.cpu() != ref).float().mean() < 0.01


def test_grouped_matmul_matches_reference(cuda, device):
    g = torch.Generator().manual_seed(3)
    x_q, x_s = ref_quant(torch.randn(20, 256, generator=g), 128, 1e-4, True)
    ws = [quantize_weight_blocks(torch.randn(144, 256, generator=g) * 0.1) for _ in range(4)]
    w_q, w_s = torch.stack([w for w, _ in ws]), torch.stack([s for _, s in ws])
    offs = torch.tensor([0, 7, 7, 19, 20], dtype=torch.int32)
    args = [t.to(device) for t in (x_q, x_s, w_q, w_s, offs)]
    out = cuda.fp8_grouped_matmul(*args, torch.float32)
    torch.testing.assert_close(
        out.cpu(), ref_grouped(x_q, x_s, w_q, w_s, offs, torch.float32), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("paged", [False, True])
def test_indexer_logits_and_topk(cuda, device, paged):
    g = torch.Generator().manual_seed(4)
    q_lens, k_lens = [1, 3, 2], [300, 150, 2]
    q, k = torch.randn(6, 32, 128, generator=g), torch.randn(452, 128, generator=g)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, torch.randn(6, 32, generator=g) / 64)
    layout = SeqLayout.from_lengths(q_lens, k_lens)
    if paged:
        bs = 16
        paged_layout = SeqLayout.from_lengths(
            q_lens, k_lens, block_size=bs, block_order=list(range(40))[::-1]
        )
        cache = torch.zeros(40, bs, 128).to(torch.float8_e4m3fn)
        scale = torch.full((40, bs), float("nan"))
        for b, (_, _, s) in enumerate(layout.request_bounds()):
            c0 = layout.host()["cu_k"][b]
            rows = paged_layout.physical_rows(b, torch.arange(s), cache)
            cache.view(-1, 128)[rows] = k8[c0 : c0 + s]
            scale.view(-1)[rows] = ks[c0 : c0 + s]
        k8, ks, layout = cache, scale, paged_layout
    dev = [t.to(device) for t in (q8, k8, ks, w8)]
    logits = cuda.fp8_indexer_logits(*dev, layout.to(device)).cpu()
    ref = ref_logits(q8, k8, ks, w8, layout)
    torch.testing.assert_close(logits, ref, rtol=2e-5, atol=1e-5)
    topk = cuda.fp8_indexer_topk(*dev, layout.to(device), 64).cpu()
    assert torch.equal(topk, ref_topk(q8, k8, ks, w8, layout, 64))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_sparse_mla_on_fp8_cache(cuda, device, dt):
    g = torch.Generator().manual_seed(5)
    bs, nb = 13, 40
    k_lens, q_lens = [300, 120], [2, 1]
    layout = SeqLayout.from_lengths(q_lens, k_lens, block_size=bs, block_order=list(range(nb))[::-1])
    cache = torch.full((nb, bs, 656), 0xFF, dtype=torch.uint8)  # unused rows: NaN everywhere
    for b, s in enumerate(k_lens):
        kv = (torch.randn(s, 576, generator=g) / 10).clamp(-1, 1).bfloat16()
        write_rows(cache, layout.physical_rows(b, torch.arange(s), cache), ref_rows(kv))
    q = torch.randn(3, 16, 576, generator=g).clamp(-1, 1).to(dt)
    idx = torch.randint(-1, 130, (3, 64), generator=g).to(torch.int32)
    idx[2] = -1
    out, lse = cuda.fp8_sparse_mla_attention(
        q.to(device), cache.to(device), idx.to(device), layout.to(device), 0.04, 512
    )
    r_out, r_lse = ref_attn(q, cache, idx, layout, 0.04, 512)
    rtol, atol = (3e-5, 1e-5) if dt == torch.float32 else (3 / 128, 8e-4)
    torch.testing.assert_close(out.cpu().float(), r_out.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.cpu(), r_lse, rtol=8 / 65536, atol=1e-6)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


@pytest.mark.parametrize("paged", [False, True])
def test_indexer_topk_is_fused_and_keeps_the_tie_rule(cuda, device, launches, paged):
    """One fused launch (no [T, S] logits, no separate top-k), bitwise the reference, with exact ties from
    duplicated keys (lower position first, across the running buffer's compactions) and -1 padding."""
    g = torch.Generator().manual_seed(7)
    q_lens, k_lens = [2, 1, 3], [700, 40, 260]
    q = torch.randint(-2, 3, (6, 4, 32), generator=g).float()
    base = torch.randint(-1, 2, (50, 32), generator=g).float()
    k = base[torch.randint(0, 50, (sum(k_lens),), generator=g)]  # every key repeats: exact ties
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    ks = torch.full((sum(k_lens),), 0.5)
    w = torch.randint(1, 3, (6, 4), generator=g).float()
    layout = SeqLayout.from_lengths(q_lens, k_lens, block_size=16 if paged else None)
    if paged:
        rows = torch.cat(
            [layout.physical_rows(b, torch.arange(s), torch.empty(0, 16, 32)) for b, s in enumerate(k_lens)]
        )
        nb = int(layout.block_table.max()) + 1
        cache = torch.full((nb * 16, 32), float("nan")).to(torch.float8_e4m3fn)
        scale = torch.full((nb * 16,), float("nan"))
        cache[rows], scale[rows] = k8, ks
        k8, ks = cache.view(nb, 16, 32), scale.view(nb, 16)
    want = ref_topk(q8, k8, ks, w, layout, 64)
    got = cuda.fp8_indexer_topk(*(t.to(device) for t in (q8, k8, ks, w)), layout.to(device), 64).cpu()
    assert torch.equal(got, want)
    assert (got[2, 40:] == -1).all() and (got[2, :40] >= 0).all()  # the 40-key request's decode row pads
    assert launches() == Counter({"fp8_indexer_topk": 1})
