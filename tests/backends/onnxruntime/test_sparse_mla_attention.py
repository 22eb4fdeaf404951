"""sparse_mla_attention on ONNX Runtime: invalid indices (-1, >= seqlens_k) and NaN in unread rows,
empty rows (out 0, lse -inf), duplicates, a cache with no rows."""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from tests.backends.reference._cases import pack


@pytest.mark.parametrize("block_size", [None, 3])
def test_invalid_indices_nan_rows_duplicates(be, ref, no_fallback, block_size):
    g = torch.Generator().manual_seed(6)
    q_lens, k_lens, h, d, dv = [2, 3], [40, 11], 4, 24, 16
    cache, layout = pack([torch.randn(s, d, generator=g) for s in k_lens], q_lens, block_size=block_size)
    q = torch.randn(5, h, d, generator=g)
    idx = torch.randint(-1, 45, (5, 12), generator=g, dtype=torch.int32)
    idx[0, :2] = 7  # a duplicate counts twice
    idx[4] = -1  # an empty row
    idx[3, :] = 11  # all out of range for request 1 (seqlens_k = 11): empty too
    out, lse = be.sparse_mla_attention(q, cache, idx, layout, 0.0625, dv)
    rout, rlse = ref.sparse_mla_attention(q, cache, idx, layout, 0.0625, dv)
    assert not torch.isnan(out).any()
    assert torch.equal(out[3:], torch.zeros_like(out[3:])) and torch.isneginf(lse[3:]).all()
    torch.testing.assert_close(out, rout)
    torch.testing.assert_close(lse, rlse)
    no_fallback(ref_calls_allowed=1)


def test_cache_without_rows(be):
    layout = SeqLayout.from_lengths([2], [0])
    out, lse = be.sparse_mla_attention(
        torch.randn(2, 2, 8, dtype=torch.bfloat16),
        torch.empty(0, 8, dtype=torch.bfloat16),
        torch.tensor([[0, -1], [3, 1]], dtype=torch.int32),
        layout,
        0.5,
        4,
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros(2, 2, 4, dtype=torch.bfloat16))
    assert torch.isneginf(lse).all()
