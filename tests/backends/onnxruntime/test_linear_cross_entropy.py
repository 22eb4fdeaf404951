"""linear_cross_entropy on ONNX Runtime: the Loop over row chunks (forced small here) sums to the
reference's loss; no counted target gives NaN."""

from __future__ import annotations

import torch

from backends.onnxruntime import linear_cross_entropy as adapter


def test_many_chunks_match_reference(be, ref, no_fallback, monkeypatch):
    monkeypatch.setattr(adapter, "CHUNK_ELEMS", 3 * 50)  # 3 rows per chunk, last one partial
    g = torch.Generator().manual_seed(11)
    h = torch.randn(10, 16, generator=g)
    w = torch.randn(50, 16, generator=g)
    t = torch.randint(0, 50, (10,), generator=g)
    t[[2, 9]] = -100
    torch.testing.assert_close(be.linear_cross_entropy(h, w, t), ref.linear_cross_entropy(h, w, t))
    t3 = torch.where(t == -100, 3, t).int()
    torch.testing.assert_close(
        be.linear_cross_entropy(h.bfloat16(), w.bfloat16(), t3, ignore_index=3),
        ref.linear_cross_entropy(h.bfloat16(), w.bfloat16(), t3, ignore_index=3),
    )
    no_fallback(ref_calls_allowed=2)


def test_no_counted_target_is_nan(be):
    loss = be.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.full((4,), -100))
    assert loss.dtype == torch.float32 and loss.dim() == 0 and torch.isnan(loss)
    assert torch.isnan(
        be.linear_cross_entropy(torch.randn(0, 8), torch.randn(5, 8), torch.empty(0, dtype=torch.long))
    )
