"""The plain-torch conversions of backends/ascend/_adapters.py, checked on hand cases."""

from __future__ import annotations

import torch

from backends import SeqLayout
from backends.ascend import _adapters as ad
from backends.reference._cache import causal_counts


def test_tnd_lengths_are_cumulative_and_pa_lengths_per_request():
    lay = SeqLayout.from_lengths([2, 0, 3], [5, 7, 4], block_size=16)
    assert ad.query_lengths_tnd(lay).tolist() == [2, 2, 5]
    assert ad.key_lengths_pa(lay).tolist() == [5, 7, 4]
    assert ad.cumulative(lay.seqlens_k).tolist() == [5, 12, 16]


def test_causal_visible_matches_the_reference_rule():
    lay = SeqLayout.from_lengths([3, 1, 2], [3, 9, 1])
    want = torch.cat([causal_counts(t, s) for t, s in ((3, 3), (1, 9), (2, 1))])
    assert ad.causal_visible(lay).tolist() == want.tolist()


def test_valid_first_keeps_order_and_packs_invalid_last():
    idx = torch.tensor([[-1, 4, 9, 2, -1, 3], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    out = ad.valid_first(idx, torch.tensor([5, 2]))
    assert out.tolist() == [[4, 2, 3, -1, -1, -1], [0, 1, -1, -1, -1, -1]]


def test_lse_from_softmax_stats_drops_padding_heads():
    smax = torch.tensor([[[1.0, 2.0, 9.0]]])  # [N2=1, T=1, N1=3]
    ssum = torch.tensor([[[2.0, 1.0, 5.0]]])
    lse = ad.lse_from_softmax_stats(smax, ssum, 2)
    assert torch.allclose(lse, torch.tensor([[1.0 + torch.log(torch.tensor(2.0)), 2.0]]))


def test_pad_heads_appends_zero_heads():
    t = torch.randn(3, 5, 4)
    p = ad.pad_heads(t, 8)
    assert p.shape == (3, 8, 4) and torch.equal(p[:, :5], t) and not p[:, 5:].any()


def test_compact_keys_is_zero_copy_for_a_packed_ragged_cache_and_gathers_otherwise():
    cache = torch.randn(12, 4)
    packed = SeqLayout.from_lengths([1, 1], [5, 7])
    keys, cum = ad.compact_keys(packed, cache)
    assert keys.data_ptr() == cache.data_ptr() and cum.tolist() == [5, 12]
    paged = SeqLayout.from_lengths([1, 1], [3, 2], block_size=2, block_order=[2, 0, 1])
    pcache = torch.arange(3 * 2 * 1, dtype=torch.float32).reshape(3, 2, 1)
    keys, cum = ad.compact_keys(paged, pcache)
    assert keys[:, 0].tolist() == [4.0, 5.0, 0.0, 2.0, 3.0] and cum.tolist() == [3, 5]


def test_w4_repack_scale_bias_is_the_int4_split_offset():
    from backends.reference.w4a8_matmul import pack_int4

    w = torch.randint(-8, 8, (1, 5, 16), dtype=torch.int8)
    scale = torch.rand(1, 5)
    weight, bits, bias, n8 = ad.repack_w4_for_npu(pack_int4(w), scale)
    assert n8 == 8 and weight.shape == (1, 16, 1) and bits.dtype == torch.int64
    assert torch.equal(bits[:, :5].to(torch.int32).view(torch.float32), scale)
    torch.testing.assert_close(bias[:, :5], 8.0 * w.float().sum(-1) * scale)
    assert not bias[:, 5:].any()
