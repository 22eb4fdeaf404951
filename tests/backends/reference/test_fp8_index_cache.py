"""The FP8 indexer cache (SPEC 7.8): keys written into vLLM's DeepSeek-V3.2 block layout (a block's e4m3
values, then its fp32 scales; a ragged cache is one block) read back through views as the contract's
quantize_indexer_inputs gives them, and indexer_topk on that cache is fp8_indexer_topk on the quantized
inputs (the query quantized inside)."""

from __future__ import annotations

import torch

import backends
from backends import SeqLayout
from backends.formats import index_cache_of, index_cache_views, quantize_indexer_inputs, write_index_cache


def test_paged_rows_are_the_contract_quantization_in_the_block_layout():
    g = torch.Generator().manual_seed(0)
    nb, bs, d = 3, 4, 128
    cache = torch.zeros(nb, bs, d + 4, dtype=torch.uint8)
    k = torch.randn(5, d, generator=g)
    rows = torch.tensor([0, 5, 6, 11, 2])
    write_index_cache(cache, rows, k)
    _, k8_want, ks_want, _ = quantize_indexer_inputs(torch.zeros(1, 1, d), k, torch.zeros(1, 1))
    keys, scales = index_cache_views(cache)
    assert keys.data_ptr() == cache.data_ptr() and scales.shape == (nb, bs)  # views, no copy
    assert torch.equal(keys.reshape(-1, d)[rows].view(torch.uint8), k8_want.view(torch.uint8))
    assert torch.equal(scales.reshape(-1)[rows], ks_want)
    # block 1 holds its 4 keys' values, then their 4 scales: row 5 is its key 1
    assert torch.equal(cache[1].reshape(-1)[bs * d :].view(torch.float32)[1], ks_want[1])


def test_a_ragged_cache_is_one_block():
    k = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    cache = index_cache_of(k)
    again = torch.zeros_like(cache)
    write_index_cache(again, torch.arange(6), k)
    assert cache.shape == (6, 20) and torch.equal(cache, again)
    assert torch.equal(cache.reshape(-1)[6 * 16 :].view(torch.float32), index_cache_views(cache)[1])


def test_indexer_topk_on_the_fp8_cache_is_fp8_indexer_topk_on_quantized_inputs():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, 32, generator=g).bfloat16(), torch.randn(12, 32, generator=g).bfloat16()
    w = torch.rand(5, 4, generator=g)
    lay = SeqLayout.from_lengths([2, 3], [5, 7])
    ref = backends.get("reference")
    got = ref.indexer_topk(q, index_cache_of(k), w, lay, 4)
    q8, k8, ks, w8 = quantize_indexer_inputs(q, k, w)
    assert torch.equal(got, ref.fp8_indexer_topk(q8, k8, ks, w8, lay, 4))
