"""indexer_logits: kernels_ascend.indexer_logits, ragged and paged, against the reference."""

from __future__ import annotations

import torch

from backends import SeqLayout


def test_matches_reference(backend, reference):
    g = torch.Generator().manual_seed(0)
    for lay, cache in (
        (
            SeqLayout.from_lengths([2, 3], [50, 70], block_size=16, block_order=[4, 3, 2, 1, 0, 8, 7, 6, 5]),
            torch.randn(9, 16, 64, generator=g),
        ),
        (SeqLayout.from_lengths([2, 3], [50, 70]), torch.randn(120, 64, generator=g)),
    ):
        q, w = torch.randn(5, 6, 64, generator=g), torch.randn(5, 6, generator=g)
        torch.testing.assert_close(
            backend.indexer_logits(q, cache, w, lay),
            reference.indexer_logits(q, cache, w, lay),
            rtol=2e-5,
            atol=1e-5,
        )
