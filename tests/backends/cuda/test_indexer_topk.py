"""cuda indexer_topk (SPEC 2.2): the fused scoring + running top-k kernel against the reference, bitwise.

Specific to the kernel: more keys than topk so the running buffer compacts several times, keys whose
logits grow with position (every key survives the threshold), exact ties from small-integer inputs and
from duplicated key rows (lower position first, across compactions), -1 padding for queries with fewer
causal keys than topk, paged caches with odd block sizes and shuffled blocks (filler rows are NaN and must
never be read), and determinism / batch invariance.
Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
"""

from __future__ import annotations

import pytest
import torch

from backends import NotSupported
from backends.reference.indexer_topk import indexer_topk as ref_topk
from kernels_cuda.indexer_topk import MAX_TOPK
from tests.backends.cuda.conftest import skip_bf16_interpreted
from tests.backends.reference._cases import int_valued, pack


def make(q_lens, k_lens, *, h_i=4, d_i=32, dtype=torch.float32, block_size=None, ints=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    if ints:  # exact dots: real ties, identical on every backend
        q = int_valued((t, h_i, d_i), gen, dtype=dtype)
        keys = [int_valued((s, d_i), gen, -1, 2, dtype=dtype) for s in k_lens]
        w = int_valued((t, h_i), gen, 1, 3)
    else:
        q = torch.randn(t, h_i, d_i, generator=gen).to(dtype)
        keys = [torch.randn(s, d_i, generator=gen).to(dtype) for s in k_lens]
        w = torch.randn(t, h_i, generator=gen)
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=seed, d=d_i, dtype=dtype)
    return q, cache, w, layout


def run(cuda, device, q, cache, w, layout, k):
    got = cuda.indexer_topk(q.to(device), cache.to(device), w.to(device), layout.to(device), k).cpu()
    return got, ref_topk(q, cache, w, layout, k)


@pytest.mark.parametrize("block_size", [None, 7, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(cuda, device, launches, dtype, block_size):
    skip_bf16_interpreted(dtype)
    q_lens, k_lens = [4, 1, 3, 0], [260, 180, 40, 7]  # chunked prefill, decode, fewer keys than topk
    got, want = run(cuda, device, *make(q_lens, k_lens, dtype=dtype, block_size=block_size), 32)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)
    assert launches()["indexer_topk"] == 1


@pytest.mark.parametrize("block_size", [None, 5])
def test_exact_ties_break_by_lower_position(cuda, device, block_size):
    got, want = run(cuda, device, *make([6, 2], [300, 120], ints=True, block_size=block_size), 48)
    assert torch.equal(got, want)


def test_duplicated_key_rows_tie(cuda, device):
    """Identical key rows give bitwise-identical logits in any summation order: a pure index tie-break."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 2, 16, generator=gen)
    keys = torch.randn(10, 16, generator=gen).repeat(25, 1)  # 250 keys, every logit 25 times
    cache, layout = pack([keys], [3], block_size=11)
    got, want = run(cuda, device, q, cache, torch.rand(3, 2, generator=gen), layout, 40)
    assert torch.equal(got, want)


def test_logits_growing_with_position(cuda, device):
    """Every new key beats the running threshold: the buffer fills and compacts on every few tiles."""
    pos = torch.arange(1, 201, dtype=torch.float32)
    keys = pos[:, None] * torch.ones(1, 16) / 200.0
    q = torch.ones(2, 2, 16)
    cache, layout = pack([keys], [2])
    got, want = run(cuda, device, q, cache, torch.ones(2, 2), layout, 16)
    assert torch.equal(got, want)
    assert got[1, 0] == 199 and got[0, 0] == 198


def test_deterministic_and_batch_invariant(cuda, device):
    q, cache, w, layout = make([5], [150], seed=3)
    a = cuda.indexer_topk(q.to(device), cache.to(device), w.to(device), layout.to(device), 24)
    b = cuda.indexer_topk(q.to(device), cache.to(device), w.to(device), layout.to(device), 24)
    assert torch.equal(a, b)
    # the last query alone (decode shape) picks what it picked inside the prefill batch
    keys = cache[2:152]
    c1, l1 = pack([keys], [1])
    alone = cuda.indexer_topk(q[4:].to(device), c1.to(device), w[4:].to(device), l1.to(device), 24)
    assert torch.equal(alone, a[4:])


def test_topk_above_limit_is_declined(cuda, device):
    q, cache, w, layout = make([1], [4])
    with pytest.raises(NotSupported, match=f"topk={MAX_TOPK + 1}"):
        cuda.indexer_topk(q.to(device), cache.to(device), w.to(device), layout.to(device), MAX_TOPK + 1)
