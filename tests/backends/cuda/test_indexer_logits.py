"""cuda indexer_logits (SPEC 2.1): the tiled scoring kernel against the reference.

Specific to the kernel: query tiles that straddle no request boundary, key tiles past the causal bound
(never read: filler rows are NaN), the block-table lookup in the kernel with odd block sizes and shuffled
blocks, padded heads / head dims, chunked prefill and decode shapes, and the no-backward decline.
Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
"""

from __future__ import annotations

import pytest
import torch

from backends import NotSupported
from backends.reference.indexer_logits import indexer_logits as ref_logits
from tests.backends.cuda.conftest import skip_bf16_interpreted
from tests.backends.reference._cases import pack

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


def make(q_lens, k_lens, h_i, d_i, dtype, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), h_i, d_i, generator=gen).to(dtype)
    keys = [torch.randn(s, d_i, generator=gen).to(dtype) for s in k_lens]
    w = torch.randn(sum(q_lens), h_i, generator=gen)
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=seed, d=d_i, dtype=dtype)
    return q, cache, w, layout


def check(cuda, device, q, cache, w, layout, dtype):
    got = cuda.indexer_logits(q.to(device), cache.to(device), w.to(device), layout.to(device)).cpu()
    want = ref_logits(q, cache, w, layout)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert not torch.isnan(got).any(), "a NaN filler row was read"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], **TOL[dtype])


@pytest.mark.parametrize("block_size", [None, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_chunked_prefill_decode(cuda, device, launches, dtype, block_size):
    skip_bf16_interpreted(dtype)
    # full prefill (T_b == S_b), chunked prefill (T_b < S_b), decode (T_b == 1), an empty request
    q_lens, k_lens = [37, 6, 1, 0], [37, 130, 75, 9]
    check(cuda, device, *make(q_lens, k_lens, 4, 32, dtype, block_size), dtype)
    assert launches()["indexer_logits"] == 1


def test_padded_heads_and_head_dim(cuda, device):
    """H_I = 3 and D_I = 20 pad to 4 and 32 inside the kernel; the padding must add exact zeros."""
    check(cuda, device, *make([5, 3], [60, 3], 3, 20, torch.float32, 7), torch.float32)


def test_more_queries_than_keys(cuda, device):
    """T_b > S_b: the first queries see no key at all (a row of -inf)."""
    check(cuda, device, *make([9], [4], 2, 16, torch.float32, None), torch.float32)


def test_inputs_requiring_grad_are_declined(cuda, device):
    q, cache, w, layout = make([3], [20], 2, 16, torch.float32, None)
    with pytest.raises(NotSupported, match="no backward"):
        cuda.indexer_logits(q.to(device).requires_grad_(), cache.to(device), w.to(device), layout.to(device))
    with torch.no_grad():  # nothing to differentiate: served
        cuda.indexer_logits(q.to(device).requires_grad_(), cache.to(device), w.to(device), layout.to(device))
