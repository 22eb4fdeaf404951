"""indexer_logits on ONNX Runtime: physical rows computed in-graph from the layout tensors; NaN in
unread cache rows never leaks; low-precision inputs accumulate in fp32."""

from __future__ import annotations

import pytest
import torch

from tests.backends.reference._cases import pack


@pytest.mark.parametrize("block_size", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_nan_filled_cache(be, ref, no_fallback, block_size, dtype):
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens, h, d = [2, 0, 3, 1], [70, 4, 33, 0], 4, 16
    cache, layout = pack(
        [torch.randn(s, d, generator=g) for s in k_lens], q_lens, block_size=block_size, d=d, dtype=dtype
    )
    q = torch.randn(sum(q_lens), h, d, generator=g).to(dtype)
    w = torch.randn(sum(q_lens), h, generator=g)
    got = be.indexer_logits(q, cache, w, layout)
    want = ref.indexer_logits(q, cache, w, layout)
    assert got.dtype == torch.float32 and got.shape == want.shape == (6, 70)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    no_fallback(ref_calls_allowed=1)
